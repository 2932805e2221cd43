"""Pure-PyTorch fp32 references for every cute_moe op (the CPU implementation).

The math, once (binding spec: FP8 = float8_e4m3fn, FP8_MAX = 448):

* FP8 quantization, per row and per group of ``g`` columns, in f32::

      amax  = max(max|x|, 1e-6)
      scale = amax / 448                         # true f32 division
      scale = 2 ** ceil(log2(scale))             # only for scale_fmt == "ue8m0" (exact, by bits)
      q     = fp8_e4m3(clamp(x / scale, -448, 448))   # round to nearest even

* Routing: top-k over f32 scores with a stable descending sort (ties -> lower
  expert id); weights times ``routed_scaling_factor``.
* Alignment: the local expert of ``id`` is ``id - expert_offset`` when it lies in
  ``[0, E_local)``; segment ``e`` holds rows ``[off[e], off[e+1])`` with
  ``off[e+1] - off[e] = round_up(count[e], alignment)``; inside a segment rows go in
  ascending flattened order ``t*k + j``; ``-1`` marks padding / non-local entries.
  Every output has a static shape (``M_cap = m_cap(T, k, E_local, alignment)``).
* Grouped GEMM: ``C[r, n] = sum_kb a_scale[r, kb] * b_scale[e, n // 128, kb] *
  sum_{k in kb} A[r, k] * B[e, n, k]``, f32 accumulation, bf16 out. Each 128-wide
  partial sum of fp8 products is computed exactly (in f64, then rounded to f32).
* finalize / moe_reduce: ``out[t] = sum_j w[t, j] * y_j`` accumulated in f32 in
  order ``j = 0..k-1``, then cast once.

Rows past ``expert_offsets[-1]`` are unspecified by the spec; these references
write zero codes there (quantizers: scale of an all-zero row; ``permute``: scale
1.0; GEMM: 0). Inputs are validated by the op layer; only cheap checks here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_MAX",
    "FP8_DTYPE",
    "AMAX_FLOOR",
    "BLOCK",
    "SCALE_FMTS",
    "ROUTING_METHODS",
    "m_cap",
    "quant_block_128x128_ref",
    "dequant_block_128x128_ref",
    "quant_fp8_ref",
    "route_ref",
    "align_ref",
    "align_local",
    "permute_quant_ref",
    "permute_ref",
    "grouped_gemm_fp8_ref",
    "grouped_gemm_fp8_swiglu_ref",
    "silu_mul_quant_ref",
    "finalize_ref",
    "moe_reduce_ref",
    "fused_moe_ref",
    "fused_moe_routed_ref",
    "fill_kv_cache_fp8_ref",
]

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
AMAX_FLOOR = 1e-6
BLOCK = 128  # activation group / weight block edge
SCALE_FMTS = (None, "ue8m0")
ROUTING_METHODS = ("softmax", "renormalize", "deepseek_v3", "llama4", "sigmoid_renorm")


# ----------------------------------------------------------------------------- helpers


def m_cap(T, k, E_local, alignment=128):
    """Static row capacity: round_up(T*k + min(T*k, E_local)*(alignment-1), alignment).

    Works for Python ints and torch SymInts (0 when T == 0).
    """
    n = T * k
    # min() for ints: torch.sym_min's checks cost microseconds on every eager align call.
    low = min(n, E_local) if type(n) is int and type(E_local) is int else torch.sym_min(n, E_local)
    rows = n + low * (alignment - 1)
    return (rows + alignment - 1) // alignment * alignment


def _check_scale_fmt(scale_fmt):
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")


def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(scale)) for positive normal f32, exactly (exponent bits, no log2 rounding)."""
    bits = scale.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless already a power of 2
    return (exp << 23).view(torch.float32)


def _quant_groups(x: torch.Tensor, group_size: int, scale_fmt):
    """Quantize the last dim of ``x`` in groups: returns (fp8 [..., K], f32 [..., K/g])."""
    K = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], K // group_size, group_size)
    amax = xg.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor: torch on CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, which is off by one ulp for about half of all amax values.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if scale_fmt == "ue8m0":
        scale = _ue8m0(scale)
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def _mn_major(scale: torch.Tensor) -> torch.Tensor:
    """Copy [rows, G] scales into an MN-major buffer (strides (1, rows))."""
    out = torch.empty(scale.shape[1], scale.shape[0], dtype=torch.float32, device=scale.device).t()
    out.copy_(scale)
    return out


def _stable_topk(scores: torch.Tensor, k: int):
    """Top-k along the last dim, descending, ties -> lower index."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def _row_mask(row_to_token: torch.Tensor, expert_offsets: torch.Tensor):
    """(gather index, valid) for permute: valid rows name a token and lie before off[-1]."""
    rows = torch.arange(row_to_token.shape[0], device=row_to_token.device)
    tok = row_to_token.long()
    valid = (tok >= 0) & (rows < expert_offsets[-1].long())
    return tok, valid


def _check_inverse(token_to_row: torch.Tensor, tok: torch.Tensor, valid: torch.Tensor) -> None:
    """ValueError unless token_to_row's entries >= 0 are exactly the valid rows, each naming back
    its own token (row_to_token[token_to_row[t, j]] == t)."""
    M = tok.shape[0]
    t2r = token_to_row.long()
    named = t2r >= 0
    rows = t2r[named]
    tokens = torch.arange(t2r.shape[0], device=t2r.device)[:, None].expand_as(t2r)[named]
    in_range = bool((rows < M).all())
    ok = in_range and bool(valid[rows].all()) and bool((tok[rows] == tokens).all())
    ok = ok and rows.numel() == int(valid.sum()) and rows.unique().numel() == rows.numel()
    if not ok:
        raise ValueError(
            "cute_moe.permute_quant: token_to_row must be the inverse of row_to_token "
            "(align's third output): every routed row named once, by its own token"
        )


def _weighted_sum(rows_f32, weights: torch.Tensor, H: int, device, valid=None) -> torch.Tensor:
    """sum_j weights[:, j] * rows_f32(j) in f32, in order j = 0..k-1; invalid entries skipped."""
    acc = torch.zeros(weights.shape[0], H, dtype=torch.float32, device=device)
    for j in range(weights.shape[1]):
        nxt = acc + weights[:, j, None].float() * rows_f32(j)
        acc = nxt if valid is None else torch.where(valid[:, j, None], nxt, acc)
    return acc


# ----------------------------------------------------------------------------- weights (tests / demos)


def quant_block_128x128_ref(w: torch.Tensor):
    """Weight quantizer: [.., N, K] -> (fp8 [.., N, K], f32 scale [.., ceil(N/128), K/128]).

    One scale per 128x128 block (N padded with zeros): scale = max(amax, 1e-6) / 448.
    """
    *lead, N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"quant_block_128x128_ref: K={K} must be a multiple of {BLOCK}")
    NB, KB = -(-N // BLOCK), K // BLOCK
    wf = F.pad(w.float(), (0, 0, 0, NB * BLOCK - N))
    blocks = wf.reshape(*lead, NB, BLOCK, KB, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR)  # [.., NB, KB]
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, NB * BLOCK, K)[..., :N, :].contiguous()
    return q, scale


def dequant_block_128x128_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quant_block_128x128_ref: f32 [.., N, K] = f32(q) * block scale."""
    *lead, N, K = q.shape
    if N % BLOCK == 0 and K % BLOCK == 0:  # whole blocks: the scales broadcast, never expanded
        if tuple(scale.shape[-2:]) != (N // BLOCK, K // BLOCK):
            raise ValueError(f"dequant_block_128x128_ref: scale must be [..., N/128, K/128] = [..., {N // BLOCK}, "
                             f"{K // BLOCK}] for q [..., {N}, {K}], got {list(scale.shape)}")  # fmt: skip
        blocks = q.float().reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        return (blocks * scale.float()[..., :, None, :, None]).reshape(*lead, N, K)
    s = scale.float().repeat_interleave(BLOCK, dim=-2)[..., :N, :].repeat_interleave(BLOCK, dim=-1)
    return q.float() * s


# ----------------------------------------------------------------------------- ops


def quant_fp8_ref(x: torch.Tensor, group_size: int = 128, scale_fmt=None, column_major_scales: bool = False):
    """Per-token-group FP8 quant: (q fp8 [M, K], scale f32 [M, K/group_size])."""
    _check_scale_fmt(scale_fmt)
    if x.shape[-1] % group_size:
        raise ValueError(f"quant_fp8_ref: K={x.shape[-1]} not divisible by group_size={group_size}")
    q, scale = _quant_groups(x, group_size, scale_fmt)
    return q, (_mn_major(scale) if column_major_scales else scale.contiguous())


def route_ref(
    router_logits: torch.Tensor,
    top_k: int,
    method: str,
    score_bias=None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
):
    """Top-k routing -> (topk_ids int32 [T, k], topk_weights f32 [T, k]); all math in f32."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"route_ref: unknown method {method!r}, expected one of {ROUTING_METHODS}")
    if method != "deepseek_v3" and (score_bias is not None or n_group != 1 or topk_group != 1):
        raise ValueError(f"route_ref: score_bias / n_group / topk_group are only for deepseek_v3, not {method!r}")
    logits = router_logits.float()
    if method == "softmax":
        w, ids = _stable_topk(torch.softmax(logits, dim=-1), top_k)
    elif method == "renormalize":
        vals, ids = _stable_topk(logits, top_k)
        w = torch.softmax(vals, dim=-1)
    elif method == "llama4":
        vals, ids = _stable_topk(logits, top_k)
        w = torch.sigmoid(vals)
    elif method == "sigmoid_renorm":
        w, ids = _stable_topk(torch.sigmoid(logits), top_k)
        w = w / w.sum(dim=-1, keepdim=True)
    else:  # deepseek_v3 (HF DeepseekV3 noaux_tc, norm_topk_prob=True)
        T, E = logits.shape
        s = torch.sigmoid(logits)
        c = s if score_bias is None else s + score_bias.float()
        grouped = c.reshape(T, n_group, E // n_group)
        top2, _ = _stable_topk(grouped, min(2, E // n_group))
        _, gidx = _stable_topk(top2.sum(dim=-1), topk_group)
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=c.device).scatter_(1, gidx, True)
        keep = keep.repeat_interleave(E // n_group, dim=1)
        _, ids = _stable_topk(c.masked_fill(~keep, float("-inf")), top_k)
        w = s.gather(1, ids)
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (w * routed_scaling_factor).float()


def align_local(topk_ids: torch.Tensor, num_local_experts: int, alignment: int, expert_offset: int):
    """align without range checks: ids outside the local range (negative ones too) are simply not local."""
    T, k = topk_ids.shape
    E = num_local_experts
    dev = topk_ids.device
    n = T * k
    M = m_cap(T, k, E, alignment)
    local = topk_ids.reshape(-1).long() - expert_offset
    is_local = (local >= 0) & (local < E)
    bucket = torch.where(is_local, local, E)  # E = "not local" bucket
    counts_all = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts_all[:E]
    padded = (counts + alignment - 1) // alignment * alignment
    offsets = torch.cat([counts.new_zeros(1), padded.cumsum(0)])
    # rank of each entry inside its bucket, in flattened order (stable sort keeps t*k + j order)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    bucket_start = counts_all.cumsum(0) - counts_all
    rank = torch.arange(n, device=dev) - bucket_start[sorted_bucket]
    sorted_local = sorted_bucket < E
    row = torch.where(sorted_local, offsets[sorted_bucket] + rank, -1)
    token_to_row = torch.empty(n, dtype=torch.long, device=dev).scatter_(0, order, row)
    # row_to_token: scatter tokens into their rows; non-local entries go to a dump slot at M
    row_to_token = torch.full((M + 1,), -1, dtype=torch.long, device=dev)
    row_to_token.scatter_(0, torch.where(sorted_local, row, M), order // max(k, 1))
    return (
        offsets.to(torch.int32),
        row_to_token[:M].to(torch.int32),
        token_to_row.reshape(T, k).to(torch.int32),
        counts.to(torch.int32),
    )


def align_ref(
    topk_ids: torch.Tensor,
    num_experts: int,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts=None,
):
    """Expert segments -> (expert_offsets [E_local+1], row_to_token [M_cap], token_to_row [T, k], counts [E_local]).

    -1 marks a masked slot (vLLM's expert map gives it for another rank's expert): not local."""
    E_local = num_experts if num_local_experts is None else num_local_experts
    if topk_ids.numel() and bool(((topk_ids < -1) | (topk_ids >= num_experts)).any()):
        raise ValueError(f"cute_moe.align: topk_ids must be -1 or lie in [0, num_experts) = [0, {num_experts})")
    return align_local(topk_ids, E_local, alignment, expert_offset)


def permute_quant_ref(
    x: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor, scale_fmt=None, token_to_row=None
):
    """Gather rows by expert and quantize: (a fp8 [M_cap, H], a_scale f32 [M_cap, H/128] MN-major).

    The result is defined by ``row_to_token`` alone; ``token_to_row`` (the inverse map, which the
    CUDA op uses to read each token once) must be exactly that inverse, as ``align`` returns it:
    checked here (ValueError), trusted by the CUDA kernel."""
    _check_scale_fmt(scale_fmt)
    tok, valid = _row_mask(row_to_token, expert_offsets)
    if token_to_row is not None:
        _check_inverse(token_to_row, tok, valid)
    T = x.shape[0]
    xz = torch.cat([x.float(), x.new_zeros(1, x.shape[1], dtype=torch.float32)])  # row T = zeros
    src = xz[torch.where(valid, tok, T)]
    q, scale = _quant_groups(src, BLOCK, scale_fmt)
    return q, _mn_major(scale)


def permute_ref(a_in: torch.Tensor, a_in_scale: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor):
    """Gather already-quantized rows: padding rows get codes 0 and scale 1.0; scales MN-major."""
    tok, valid = _row_mask(row_to_token, expert_offsets)
    T, H = a_in.shape
    codes = torch.cat([a_in.view(torch.uint8), a_in.new_zeros(1, H, dtype=torch.uint8)])
    scales = torch.cat([a_in_scale.float(), a_in_scale.new_ones(1, a_in_scale.shape[1], dtype=torch.float32)])
    idx = torch.where(valid, tok, T)
    return codes[idx].view(FP8_DTYPE), _mn_major(scales[idx])


def grouped_gemm_fp8_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_counts: "torch.Tensor | None" = None,
) -> torch.Tensor:
    """Block-scaled grouped GEMM: C[rows of e] = A . B[e]^T -> bf16 [M_cap, N] (rows past off[-1]: 0).

    With ``expert_counts``, rows of segment e at or past ``off[e] + counts[e]`` are padding: 0 here
    (the kernel's output there is unspecified)."""
    M, K = a.shape
    E, N, _ = b.shape
    KB = K // BLOCK
    c = torch.zeros(M, N, dtype=torch.bfloat16, device=a.device)
    bounds = expert_offsets.tolist()  # host sync: segment bounds drive the slicing
    counts = None if expert_counts is None else expert_counts.tolist()
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if counts is not None:
            hi = min(hi, lo + max(counts[e], 0))
        if hi <= lo:
            continue
        ae = a[lo:hi].float().double()
        be = b[e].float().double()
        bs = b_scale[e].float().repeat_interleave(BLOCK, dim=0)[:N]  # [N, KB]
        acc = torch.zeros(hi - lo, N, dtype=torch.float32, device=a.device)
        for kb in range(KB):
            ks = slice(kb * BLOCK, (kb + 1) * BLOCK)
            partial = (ae[:, ks] @ be[:, ks].t()).float()  # exact block sum, rounded once to f32
            acc += (a_scale[lo:hi, kb, None].float() * bs[None, :, kb]) * partial
        c[lo:hi] = acc.to(torch.bfloat16)
    return c


def grouped_gemm_fp8_swiglu_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_counts: "torch.Tensor | None" = None,
    gate_first: bool = True,
    scale_fmt: "str | None" = None,
):
    """The w13 GEMM, then SwiGLU and re-quantization: ``silu_mul_quant_ref(grouped_gemm_fp8_ref(...))``
    (the GEMM's output rounded to bf16 between the two)."""
    h = grouped_gemm_fp8_ref(a, a_scale, w13, w13_scale, expert_offsets, expert_counts)
    return silu_mul_quant_ref(h, expert_offsets, gate_first, scale_fmt, expert_counts)


def silu_mul_quant_ref(
    h: torch.Tensor,
    expert_offsets: torch.Tensor,
    gate_first: bool = True,
    scale_fmt=None,
    expert_counts: "torch.Tensor | None" = None,
):
    """SwiGLU then FP8 quant: (a2 fp8 [M_cap, I], a2_scale f32 [M_cap, I/128] MN-major).

    With ``expert_counts``, rows of segment e at or past ``off[e] + counts[e]`` are padding and
    unspecified (the kernel skips them); this reference computes them as it does without counts,
    so its output does not depend on ``expert_counts``."""
    _check_scale_fmt(scale_fmt)
    hf = h.float()
    I = hf.shape[1] // 2
    first, second = hf[:, :I], hf[:, I:]
    gate, up = (first, second) if gate_first else (second, first)
    y = F.silu(gate) * up
    rows = torch.arange(h.shape[0], device=h.device)
    y = torch.where((rows < expert_offsets[-1].long())[:, None], y, 0.0)
    q, scale = _quant_groups(y, BLOCK, scale_fmt)
    return q, _mn_major(scale)


def finalize_ref(y: torch.Tensor, topk_weights: torch.Tensor, token_to_row: torch.Tensor) -> torch.Tensor:
    """out[t] = bf16(sum_j w[t, j] * y[token_to_row[t, j]]), f32 in order j; -1 entries skipped."""
    rows = token_to_row.long()
    valid = rows >= 0
    yz = torch.cat([y.float(), y.new_zeros(1, y.shape[1], dtype=torch.float32)])  # row M_cap = zeros
    idx = torch.where(valid, rows, y.shape[0])
    out = _weighted_sum(lambda j: yz[idx[:, j]], topk_weights, y.shape[1], y.device, valid)
    return out.to(torch.bfloat16)


def moe_reduce_ref(hidden: torch.Tensor, weights: torch.Tensor, fp32_acc: bool = False) -> torch.Tensor:
    """lmdeploy-style reduce: out[t] = sum_j weights[t, j] * hidden[t, j], output in hidden's dtype.

    fp32_acc=True (or f32 hidden): f32 products and sums in order j, one final rounding.
    fp32_acc=False with 16-bit hidden, as lmdeploy: the weights cast to hidden's dtype and
    every product and running sum rounded to it, in order j (torch's 16-bit arithmetic).
    """
    if fp32_acc or hidden.dtype == torch.float32:
        return _weighted_sum(lambda j: hidden[:, j].float(), weights, hidden.shape[2], hidden.device).to(hidden.dtype)
    w = weights.to(hidden.dtype)
    acc = torch.zeros(hidden.shape[0], hidden.shape[2], dtype=hidden.dtype, device=hidden.device)
    for j in range(hidden.shape[1]):
        acc = acc + w[:, j : j + 1] * hidden[:, j]
    return acc


def fused_moe_routed_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    expert_offset: int = 0,
    gate_first: bool = True,
    act_scale_fmt=None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Whole MoE layer from precomputed top-k; ids outside [expert_offset, expert_offset+E_local) contribute nothing.

    apply_router_weight_on_input: expert j of token t gets x[t] * w[t, j] (w rounded to x's dtype first,
    the product rounded to it, as HF Llama-4 and vLLM) and the k outputs are summed unweighted: each
    slot is a top-1 token of its own, and finalize sums a token's k bf16 rows with weight 1."""
    T, k = topk_ids.shape
    ids = topk_ids
    if apply_router_weight_on_input:
        x = (x[:, None, :] * topk_weights.to(x.dtype)[:, :, None]).reshape(T * k, x.shape[1])
        ids = topk_ids.reshape(T * k, 1)
        topk_weights = torch.ones(T, k, dtype=torch.float32, device=x.device)
    offsets, row_to_token, token_to_row, _ = align_local(ids, w13.shape[0], BLOCK, expert_offset)
    a, a_scale = permute_quant_ref(x, row_to_token, offsets, act_scale_fmt)
    h = grouped_gemm_fp8_ref(a, a_scale, w13, w13_scale, offsets)
    a2, a2_scale = silu_mul_quant_ref(h, offsets, gate_first, act_scale_fmt)
    y = grouped_gemm_fp8_ref(a2, a2_scale, w2, w2_scale, offsets)
    return finalize_ref(y, topk_weights.float(), token_to_row.reshape(T, k)).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    top_k: int,
    routing_method: str,
    score_bias=None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    expert_offset: int = 0,
    num_experts=None,
    gate_first: bool = True,
    act_scale_fmt=None,
    apply_router_weight_on_input=None,
) -> torch.Tensor:
    """Whole MoE layer from router logits: route_ref -> fused_moe_routed_ref.

    apply_router_weight_on_input=None: on the input for llama4 routing, on the outputs otherwise."""
    if num_experts is not None and num_experts != router_logits.shape[1]:
        raise ValueError(
            f"fused_moe_ref: num_experts={num_experts} must equal router_logits.shape[1]={router_logits.shape[1]}"
        )
    ids, w = route_ref(router_logits, top_k, routing_method, score_bias, n_group, topk_group, routed_scaling_factor)
    on_input = routing_method == "llama4" if apply_router_weight_on_input is None else apply_router_weight_on_input
    return fused_moe_routed_ref(
        x, ids, w, w13, w13_scale, w2, w2_scale, expert_offset, gate_first, act_scale_fmt, on_input
    )


def fill_kv_cache_fp8_ref(
    k_states: torch.Tensor,
    v_states,
    k_cache: torch.Tensor,
    v_cache,
    k_scale_cache: torch.Tensor,
    v_scale_cache,
    cu_seqlens_q: torch.Tensor,
    kv_seqlens: torch.Tensor,
    block_offsets: torch.Tensor,
    group_size: int = 128,
    scale_fmt=None,
    layout: str = "bshd",
) -> None:
    """Quantize new K (and V) tokens into a paged FP8 cache in place; returns None.

    Token j of sequence b goes to pos = kv_seqlens[b] - q_len_b + j, i.e.
    block block_offsets[b, pos // block_size], slot pos % block_size.
    """
    _check_scale_fmt(scale_fmt)
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"fill_kv_cache_fp8_ref: layout must be 'bshd' or 'bhsd', got {layout!r}")
    dev = k_states.device
    N_tok = k_states.shape[0]
    block_size = k_cache.shape[1] if layout == "bshd" else k_cache.shape[2]
    cu = cu_seqlens_q.long()
    B = cu.shape[0] - 1
    if B == 0:  # no sequence: no token is written
        return
    tok = torch.arange(N_tok, device=dev)
    b = torch.searchsorted(cu[1:].contiguous(), tok, right=True)  # sequence of each token (B = none)
    bc = b.clamp_max(max(B - 1, 0))
    j = tok - cu[bc]
    pos = kv_seqlens.long()[bc] - (cu[bc + 1] - cu[bc]) + j
    # Slots the kernel cannot address are skipped, as the kernel skips them: positions before the
    # cache start, block indices past max_blocks, block ids outside [0, num_blocks).
    # Tokens before cu_seqlens_q[0] or past cu_seqlens_q[-1] belong to no sequence.
    keep = (b < B) & (tok >= cu[bc]) & (pos >= 0) & (pos // block_size < block_offsets.shape[1])
    tok, bc, pos = tok[keep], bc[keep], pos[keep]
    blk = block_offsets.long()[bc, pos // block_size]
    in_range = (blk >= 0) & (blk < k_cache.shape[0])
    tok, blk, slot = tok[in_range], blk[in_range], (pos % block_size)[in_range]

    def write(states, cache, scale_cache):
        q, s = _quant_groups(states[tok], group_size, scale_fmt)  # [n, H, D], [n, H, D/g]
        codes = cache.view(torch.uint8)
        scales = scale_cache
        if layout == "bhsd":  # view as bshd: index_put_ writes through to the original storage
            codes, scales = codes.transpose(1, 2), scales.transpose(1, 2)
        codes[blk, slot] = q.view(torch.uint8)
        scales[blk, slot] = s.to(scales.dtype)

    write(k_states, k_cache, k_scale_cache)
    if v_states is not None:
        write(v_states, v_cache, v_scale_cache)
    return None
