"""Typed Python API over ``torch.ops.cute_moe.*``.

Every function here is a thin call of the custom op of the same name (so it
traces under ``torch.compile(fullgraph=True)`` and works in CUDA graphs); the op
validates its inputs and raises ``TypeError`` / ``ValueError`` naming the
argument. Eager calls on CUDA tensors skip the dispatcher and call the op's CUDA
implementation directly (``cute_moe.ops.call``), except ``fused_moe``,
``fused_moe_routed`` and ``fill_kv_cache_fp8``, which go through ``torch.ops``; calls that go
through it have each argument's Python type checked against the op's schema first
(``cute_moe.ops.dispatch``), since the dispatcher converts without a word (``True`` for an
int is 1, ``None`` for a bool ``False``), as it still does for ``torch.ops.cute_moe.*``
called directly. Arguments with a default are keyword-only.

Conventions: FP8 is ``torch.float8_e4m3fn`` (max 448). Activation scales are
f32, one per row per 128 columns, logical shape ``[rows, K/128]``; the
producers feeding the GEMM (``permute_quant``, ``permute``, ``silu_mul_quant``)
return them MN-major, i.e. with strides ``(1, rows)``. Index tensors are int32
with ``-1`` for "padding row" / "expert not local"; their entries must be in range
(``row_to_token`` in ``[-1, T)``, ``token_to_row`` in ``[-1, M_cap)``, ``expert_offsets``
non-decreasing in ``[0, M_cap]``, ``expert_counts[e]`` at most segment e's length): the
CPU implementations check that (``ValueError``); the GPU kernels cannot without a host
sync, and out-of-range entries are outside the contract there (``CUTE_MOE_DEBUG=1`` turns
on the same checks there, with a host sync, and on the KV cache's block ids). ``M_cap`` is the static row
bound ``round_up(T*k + min(T*k, E_local)*(alignment-1), alignment)`` (0 when
T == 0), see :func:`cute_moe.reference.m_cap`.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from cute_moe.ops import call as _call  # (importing cute_moe.ops registers torch.ops.cute_moe.*)
from cute_moe.ops import dispatch as _dispatch

__all__ = [
    "align",
    "fill_kv_cache_fp8",
    "finalize",
    "fused_moe",
    "fused_moe_routed",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_swiglu",
    "moe_reduce",
    "permute",
    "permute_quant",
    "quant_fp8",
    "route",
    "silu_mul_quant",
]

def quant_fp8(
    x: Tensor, *, group_size: int = 128, scale_fmt: Optional[str] = None, column_major_scales: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-token-group FP8 quantization.

    Args:
        x: ``[M, K]`` bf16, fp16 or f32, last dim contiguous.
        group_size: columns per scale; must divide K.  On the GPU a power of two in ``[32, 1024]``
            (``NotImplementedError`` otherwise; the CPU takes any divisor).
        scale_fmt: ``None`` (scale = amax/448) or ``"ue8m0"`` (scale rounded up to a power of two,
            still stored as f32).
        column_major_scales: return the scales MN-major (strides ``(1, M)``, M not padded: vLLM's
            ``column_major_scales``; DeepGEMM's TMA-aligned layout pads M to a multiple of 4)
            instead of row-major.

    ``amax`` has a floor of 1e-6 (``scale = max(amax, 1e-6) / 448``; vLLM and SGLang use 1e-10):
    only groups whose values are all below 1e-6 in magnitude see it. Inputs must be finite: a NaN
    or inf makes the codes *and the scale* of its group unspecified (the CPU and the GPU may differ).

    Returns:
        ``(q, scale)``: q ``[M, K]`` float8_e4m3fn, scale ``[M, K/group_size]`` f32.
    """
    return _call("quant_fp8", x, group_size, scale_fmt, column_major_scales)


def route(
    router_logits: Tensor,
    top_k: int,
    method: str,
    *,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Top-k expert routing (all math in f32; ties go to the lower expert id, judged on the score
    each method ranks by below: ``renormalize`` and ``llama4`` rank the logits themselves, so two
    logits whose softmax values round equal are not a tie there).

    Args:
        router_logits: ``[T, E]`` f32, bf16 or fp16 (converted to f32, exactly; on the GPU that copy
            keeps fp16 calls off the launch memo's replays), finite (not checked: a NaN or inf in a
            row gives that token an unspecified selection and weights, NaN for some methods; other
            tokens are unaffected).
        top_k: experts per token, ``1 <= top_k <= E``.
        method: ``"softmax"``, ``"renormalize"``, ``"deepseek_v3"``, ``"llama4"`` or ``"sigmoid_renorm"``.
        score_bias: ``[E]`` f32 correction bias, ``deepseek_v3`` only.  Finite, or ``-inf`` to mask an
            expert (each token still gets ``top_k`` experts: masked ones where too few others
            remain).  A NaN or ``+inf`` entry, which would draw every token to its expert, raises
            ``ValueError`` on the CPU, and on the GPU under ``CUTE_MOE_DEBUG=1`` (a host sync;
            unchecked otherwise).
        n_group, topk_group: grouped top-k (``deepseek_v3`` only; 1 otherwise). ``E % n_group == 0``,
            ``topk_group <= n_group``, ``top_k <= topk_group * E / n_group``.
        routed_scaling_factor: multiplies the final weights (every method); finite, > 0 and within
            float32's normal range.

    The methods (``s``: scores over all E experts; ``w``: the chosen experts' weights):

    * ``softmax``: ``s = softmax(logits)``, top-k of ``s``, ``w = s`` (Qwen2-MoE, OLMoE, Qwen3-MoE with
      ``norm_topk_prob=False``).
    * ``renormalize``: top-k of the logits, ``w`` their softmax (Mixtral, Qwen3-MoE with
      ``norm_topk_prob=True``).
    * ``deepseek_v3``: ``s = sigmoid(logits)``; the top-k of ``s + score_bias`` inside the
      ``topk_group`` groups whose two best biased scores sum highest; ``w = s`` of those,
      **renormalized** to sum 1 (HF's ``norm_topk_prob=True``). DeepSeek-V3/R1 and GLM-4.5; with
      ``n_group=1`` Kimi-K2, MiniMax-M2, LFM2-MoE and AFMoE (its ``route_scale`` is
      ``routed_scaling_factor``). A model of this family with ``norm_topk_prob=False`` is not
      covered: route it with its own code and call :func:`fused_moe_routed`.
    * ``llama4``: top-k of the logits, ``w = sigmoid(logit)`` (Llama-4, which applies ``w`` to the
      expert's input: see ``apply_router_weight_on_input`` of :func:`fused_moe`).
    * ``sigmoid_renorm``: top-k of ``sigmoid(logits)``, renormalized.

    On the GPU: ``E <= 512``, ``top_k <= 32`` (``<= 8`` for ``deepseek_v3``); ``NotImplementedError``
    otherwise, where the CPU computes the same routing. Sigmoid scores of logits below about -87
    flush to 0 on the GPU (the CPU keeps subnormals), so a renormalizing method whose chosen
    logits are all that low can give NaN weights there: real router logits are far from it.

    Returns:
        ``(topk_ids, topk_weights)``: int32 ``[T, top_k]`` and f32 ``[T, top_k]``, each row in
        descending selection score.
    """
    return _call("route", router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor)


def align(
    topk_ids: Tensor,
    num_experts: int,
    *,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group the (token, slot) pairs by local expert into row segments padded to ``alignment``.

    Args:
        topk_ids: ``[T, k]`` int32 global expert ids in ``[0, num_experts)``, or -1 for a masked
            slot (as vLLM's expert map marks another rank's expert), which is not local. Other ids
            are outside the contract: the CPU implementation raises ``ValueError``; the GPU kernel
            cannot check them without a host sync (``CUTE_MOE_DEBUG=1`` does) and treats them as
            not local.
        num_experts: global expert count.
        alignment: row alignment of each expert segment. :func:`grouped_gemm_fp8` on the GPU needs a
            multiple of 128 (its tile M); with another value its tiles of a misaligned segment come
            out NaN.
        expert_offset, num_local_experts: this rank owns experts
            ``[expert_offset, expert_offset + E_local)``; ``E_local = num_local_experts or num_experts``.

    On the GPU: ``E_local <= 1024`` and ``T * k <= 2**22`` (``NotImplementedError`` otherwise).

    Returns:
        ``(expert_offsets [E_local+1], row_to_token [M_cap], token_to_row [T, k], expert_counts [E_local])``,
        all int32. Rows are assigned in ascending ``t*k + j`` order within a segment; unused rows hold -1.
    """
    return _call("align", topk_ids, num_experts, alignment, expert_offset, num_local_experts)


def permute_quant(
    x: Tensor,
    row_to_token: Tensor,
    expert_offsets: Tensor,
    *,
    scale_fmt: Optional[str] = None,
    token_to_row: Optional[Tensor] = None,
    zero_padding: bool = True,
) -> tuple[Tensor, Tensor]:
    """Gather token rows into expert order and quantize them to FP8 (1x128 groups).

    Args:
        x: ``[T, H]`` bf16 or fp16, ``H % 128 == 0``.
        row_to_token: ``[M_cap]`` int32 from :func:`align`: token ids, -1 for padding. (vLLM's
            ``sorted_token_ids`` hold flattened slots ``t*k + j`` padded with ``T*k``:
            ``where(s < T*k, s // k, -1)`` converts them. The GPU skips entries outside
            ``[-1, T)`` unless ``CUTE_MOE_DEBUG=1``.)
        expert_offsets: ``[E_local+1]`` int32 from :func:`align`.
        scale_fmt: ``None`` or ``"ue8m0"``.
        token_to_row: optional ``[T, k]`` int32/int64 from :func:`align`, exactly the inverse of
            ``row_to_token`` (``-1`` = expert not local; checked on the CPU, trusted on the GPU,
            where a row it does not name is left unwritten). It does not change the result;
            given it, the CUDA kernel reads and quantizes each token row once and stores it to
            its ``k`` rows (without it, each routed row is gathered and quantized on its own).
        zero_padding: ``False`` leaves the padding rows inside the segments unspecified, for a
            consumer that never reads them (:func:`grouped_gemm_fp8` and :func:`silu_mul_quant`
            given align's ``expert_counts``, as :func:`fused_moe_routed` calls them); with
            ``token_to_row`` the CUDA kernel then skips writing them, most of its work at decode.

    On the GPU x's rows must be 16-byte aligned (``ValueError`` otherwise).

    Returns:
        ``(a, a_scale)``: a ``[M_cap, H]`` float8_e4m3fn, a_scale ``[M_cap, H/128]`` f32 MN-major.
        Padding rows inside a segment are zero codes (the scale of an all-zero group) unless
        ``zero_padding=False``; rows ``>= expert_offsets[-1]`` are unspecified.
    """
    return _call("permute_quant", x, row_to_token, expert_offsets, scale_fmt, token_to_row, zero_padding)


def permute(a_in: Tensor, a_in_scale: Tensor, row_to_token: Tensor, expert_offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Gather already-quantized rows (and their scales) into expert order.

    Args:
        a_in: ``[T, H]`` float8_e4m3fn, ``H % 128 == 0``.
        a_in_scale: ``[T, H/128]`` f32, any strides.
        row_to_token, expert_offsets: from :func:`align` (see :func:`permute_quant`).

    On the GPU a_in's rows must be 16-byte aligned (``ValueError`` otherwise).

    Returns:
        ``(a [M_cap, H] fp8, a_scale [M_cap, H/128] f32 MN-major)``; padding rows get codes 0 and scale 1.0.
    """
    return _call("permute", a_in, a_in_scale, row_to_token, expert_offsets)


def grouped_gemm_fp8(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    expert_offsets: Tensor,
    *,
    expert_counts: Optional[Tensor] = None,
    expected_m: Optional[int] = None,
) -> Tensor:
    """Grouped FP8 GEMM with DeepSeek-V3 block scales: ``C[rows of e] = A @ B[e]^T``.

    Args:
        a: ``[M_cap, K]`` float8_e4m3fn, ``K % 128 == 0``.
        a_scale: ``[M_cap, K/128]`` f32 (1x128 blocks); the CUDA kernel needs it MN-major (strides
            ``(1, M_cap)``, as permute_quant and silu_mul_quant write it), the CPU takes any strides.
        b: ``[E, N, K]`` float8_e4m3fn, K-major, ``N % 8 == 0``.
        b_scale: ``[E, ceil(N/128), K/128]`` f32 (128x128 blocks, HF's ``weight_scale_inv`` per
            expert), unit last stride. A ``[E, K/128, N/128]`` tensor (the transpose) is refused by
            its shape unless ``ceil(N/128) == K/128``, where nothing can tell it apart: it is then
            misread.  Scales must be finite and > 0 (a NaN or infinite one gives NaN outputs); the
            op does not read them on the host to check (``FusedMoE`` checks its weights' once).
        expert_offsets: ``[E+1]`` int32; segment e is rows ``[off[e], off[e+1])`` (``off[0]`` is
            normally 0; rows before it are unspecified, like rows ``>= off[-1]``). DeepGEMM's
            contiguous layout (``m_indices`` per row, each expert's rows in one block padded to 128
            with -1 rows at its end) maps to ``off = cat([0, cumsum(round_up(count_e, 128))])`` with
            ``count_e`` the rows of expert e, which are also the ``expert_counts``.
        expert_counts: optional ``[E]`` int32, rows of segment e that hold data (``align``'s fourth
            output); the rest of the segment is padding, and the kernel may skip it.
        expected_m: optional int >= 0, the real rows an expert is expected to hold (DeepGEMM's
            ``expected_m``): the H100/H200 kernel picks its tile and cluster shape from it.  By
            default it is estimated from ``M_cap``, which overcounts on an expert-parallel slice
            (``M_cap`` sized for every routed row): there pass ``T * top_k // num_experts``, as
            :func:`fused_moe` does.  A hint only: the result is the same either way.

    On the GPU: ``M_cap % 128 == 0`` (``NotImplementedError`` otherwise) and every segment's length a
    multiple of 128 (``align(..., alignment=128)``): the kernel cannot check that without a host sync,
    and writes the tiles of a segment that breaks it as NaN.  The CPU takes any segments.

    Returns:
        ``c``: ``[M_cap, N]`` bf16 (f32 accumulation); rows outside the segments unspecified (the
        GPU may write some of them), and with ``expert_counts`` padding rows unspecified too.
    """
    return _call("grouped_gemm_fp8", a, a_scale, b, b_scale, expert_offsets, expert_counts, expected_m)


def grouped_gemm_fp8_swiglu(
    a: Tensor,
    a_scale: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    expert_offsets: Tensor,
    *,
    expert_counts: Optional[Tensor] = None,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expected_m: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """The MoE layer's first GEMM and its SwiGLU in one step: :func:`grouped_gemm_fp8` with
    ``b = w13`` ([E, 2I, K], gate rows first unless ``gate_first=False``), then
    :func:`silu_mul_quant` of its output with the same ``expert_offsets`` / ``expert_counts``.

    Returns ``(a2 [M_cap, I] float8_e4m3fn, a2_scale [M_cap, I/128] f32, MN-major)``, what the second
    GEMM loads.  ``I % 128 == 0``.  On the H100/H200 one kernel computes it, with the GEMM's output
    rounded to bf16 in registers as the two steps round it in memory: the same codes and scales, bit
    for bit.  Its tile is the GEMM's: 128x256 (about one real M tile per expert or more, from
    ``expected_m`` as for :func:`grouped_gemm_fp8`; with ``expert_counts`` and no ``expected_m``
    also at least 64 experts), a gate block and its up block; else 128x128, 64 gate and 64 up
    columns, the cluster pair's two tiles sharing each row's 1x128 group.  It is those two steps
    where the 128x128 GEMM would store dense tiles behind (K <= 2048, under 64 experts without
    ``expected_m``, from 2.25 M tiles of rows per expert by M_cap's estimate: the two steps were
    the quicker there), and elsewhere (the CPU, other GPUs).  Rows outside the segments (and with
    ``expert_counts`` padding rows) are unspecified: which of them each form writes differs.

    On the GPU, as for :func:`grouped_gemm_fp8`: ``M_cap % 128 == 0`` (``NotImplementedError``
    otherwise), every segment's length a multiple of 128 (``align(..., alignment=128)``; a segment
    that breaks it comes out as NaN), ``a_scale`` MN-major.
    """
    return _call("grouped_gemm_fp8_swiglu", a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first,
                 scale_fmt, expected_m)  # fmt: skip


def silu_mul_quant(
    h: Tensor,
    expert_offsets: Tensor,
    *,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expert_counts: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """SwiGLU ``silu(gate) * up`` in f32, re-quantized to FP8 (1x128 groups).

    Args:
        h: ``[M_cap, 2I]`` bf16, ``I % 128 == 0``.
        expert_offsets: ``[E+1]`` int32.
        gate_first: ``True``: gate = ``h[:, :I]``, up = ``h[:, I:]`` (HF, vLLM's and FlashInfer's
            ``silu_and_mul``); ``False``: up first, for w13 weights stored up rows first (the
            ``[up, gate]`` order of FlashInfer's CUTLASS / TRT-LLM fused-MoE weights, vLLM's "w31").
        scale_fmt: ``None`` or ``"ue8m0"``.
        expert_counts: optional ``[E]`` int32, rows of segment e that hold data (``align``'s fourth
            output); the rest of the segment is padding, which the CUDA kernel then neither reads
            nor writes (the traffic is the routed rows only).

    Returns:
        ``(a2 [M_cap, I] fp8, a2_scale [M_cap, I/128] f32 MN-major)``; rows ``>= expert_offsets[-1]``
        unspecified, and with ``expert_counts`` padding rows (``off[e] + counts[e] <= row < off[e+1]``)
        unspecified too.
    """
    return _call("silu_mul_quant", h, expert_offsets, gate_first, scale_fmt, expert_counts)


def finalize(y: Tensor, topk_weights: Tensor, token_to_row: Tensor) -> Tensor:
    """Weighted un-permute: ``out[t] = bf16(sum_j w[t, j] * y[token_to_row[t, j]])``, f32, j in order.

    Args:
        y: ``[M_cap, H]`` bf16 (the second GEMM's output).
        topk_weights: ``[T, k]`` f32.
        token_to_row: ``[T, k]`` int32; ``-1`` entries contribute nothing.

    On the GPU: ``k <= 32``, ``H % 8 == 0`` (16-byte rows); ``NotImplementedError`` otherwise.

    Returns:
        ``out``: ``[T, H]`` bf16. Deterministic (no atomics).
    """
    return _call("finalize", y, topk_weights, token_to_row)


def moe_reduce(hidden: Tensor, weights: Tensor, *, fp32_acc: bool = False) -> Tensor:
    """lmdeploy-compatible weighted reduce ``out[t] = sum_j weights[t, j] * hidden[t, j]``.

    Args:
        hidden: ``[T, k, H]`` bf16, fp16 or f32.
        weights: ``[T, k]`` f32.
        fp32_acc: accumulate in f32; else, for 16-bit hidden, lmdeploy's rounding model: the
            weights cast to hidden's dtype and every product and running sum rounded to it, in
            order j (on every device). lmdeploy's Triton kernel sums in a tree order of its own,
            so the two agree in error size, not bit for bit.

    On the GPU: ``k <= 32`` and 16-byte rows; ``NotImplementedError`` otherwise.

    Returns:
        ``out``: ``[T, H]`` in hidden's dtype.
    """
    return _call("moe_reduce", hidden, weights, fp32_acc)


def fused_moe_routed(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    *,
    expert_offset: int = 0,
    gate_first: bool = True,
    act_scale_fmt: Optional[str] = None,
    apply_router_weight_on_input: bool = False,
    num_experts: Optional[int] = None,
) -> Tensor:
    """A whole FP8 MoE layer from precomputed top-k:
    align -> permute_quant -> grouped_gemm_fp8_swiglu(w13) -> grouped_gemm_fp8(w2) -> finalize
    (:func:`grouped_gemm_fp8_swiglu` is the w13 GEMM then :func:`silu_mul_quant`, one kernel where it can).

    Args:
        x: ``[T, H]`` bf16 or fp16, ``H % 128 == 0``, ``H >= 128``; on the GPU rows 16-byte aligned.
        topk_ids: ``[T, k]`` int32 global expert ids; ids outside
            ``[expert_offset, expert_offset + E_local)``, negative ones included (-1 for a masked
            slot, as vLLM's expert map gives), are not local and contribute nothing.
            On the GPU ``k <= 32`` (``NotImplementedError`` otherwise, before any launch).
        topk_weights: ``[T, k]`` f32, bf16 or fp16 (converted to f32, exactly).
        w13: ``[E_local, 2I, H]`` float8_e4m3fn (gate rows first when ``gate_first``), ``I % 128 == 0``,
            ``I >= 128``.
        w13_scale: ``[E_local, 2I/128, H/128]`` f32, unit last stride.
        w2: ``[E_local, H, I]`` float8_e4m3fn.
        w2_scale: ``[E_local, H/128, I/128]`` f32, unit last stride.
        expert_offset: first global expert id owned by this rank.
        gate_first: half order of w13's output (see :func:`silu_mul_quant`).
        act_scale_fmt: scale format of the activation quantizations (``None`` or ``"ue8m0"``).
        apply_router_weight_on_input: ``False``: ``out[t] = sum_j w[t, j] * expert_j(x[t])`` (DeepSeek,
            Qwen, Mixtral). ``True``: ``out[t] = sum_j expert_j(w[t, j] * x[t])``, HF Llama-4's
            convention (vLLM's flag of the same name; ``w`` is rounded to x's dtype and the product
            too, as both compute it). The SwiGLU makes the two differ. With ``k > 1`` each slot runs
            as a token of its own: ``k`` scaled copies of ``x`` (``[T*k, H]``) are made.
        num_experts: optional global expert count (vLLM's ``global_num_experts``), at least
            ``expert_offset + E_local``.  A performance hint: the GEMMs then size their tiles for
            ``T * k // num_experts`` rows per expert (``grouped_gemm_fp8``'s ``expected_m``) instead of
            estimating from a capacity that counts every routed row as local, which on an
            expert-parallel slice reads EP x the real rows.  The result is the same either way; ids
            are not checked against it.

    Returns:
        ``out``: ``[T, H]`` in x's dtype (finalize sums in f32 and rounds to bf16; fp16 output is
        converted from that).
    """
    return _dispatch(
        "fused_moe_routed", x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, gate_first,
        act_scale_fmt, apply_router_weight_on_input, num_experts,
    )  # fmt: skip


def fused_moe(
    x: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
    routing_method: str,
    *,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    expert_offset: int = 0,
    num_experts: Optional[int] = None,
    gate_first: bool = True,
    act_scale_fmt: Optional[str] = None,
    apply_router_weight_on_input: Optional[bool] = None,
) -> Tensor:
    """A whole FP8 MoE layer from router logits: :func:`route` then :func:`fused_moe_routed`.

    Args:
        x: ``[T, H]`` bf16 or fp16.
        router_logits: ``[T, E_global]`` f32, bf16 or fp16.
        w13, w13_scale, w2, w2_scale: the local experts' weights, see :func:`fused_moe_routed`.
        top_k, routing_method, score_bias, n_group, topk_group, routed_scaling_factor: see :func:`route`.
        expert_offset: this rank owns experts ``[expert_offset, expert_offset + E_local)``, which must lie
            inside ``[0, E_global)``.
        num_experts: global expert count; defaults to ``router_logits.shape[1]`` and must equal it if given.
        gate_first, act_scale_fmt: see :func:`fused_moe_routed`.
        apply_router_weight_on_input: see :func:`fused_moe_routed`. ``None`` (default): ``True`` for
            ``routing_method="llama4"`` (the model's convention), ``False`` otherwise.

    Returns:
        ``out``: ``[T, H]`` in x's dtype.
    """
    return _dispatch(
        "fused_moe", x, router_logits, w13, w13_scale, w2, w2_scale, top_k, routing_method, score_bias, n_group,
        topk_group, routed_scaling_factor, expert_offset, num_experts, gate_first, act_scale_fmt,
        apply_router_weight_on_input,
    )  # fmt: skip


def fill_kv_cache_fp8(
    k_states: Tensor,
    v_states: Optional[Tensor],
    k_cache: Tensor,
    v_cache: Optional[Tensor],
    k_scale_cache: Tensor,
    v_scale_cache: Optional[Tensor],
    cu_seqlens_q: Tensor,
    kv_seqlens: Tensor,
    block_offsets: Tensor,
    *,
    group_size: int = 128,
    scale_fmt: Optional[str] = None,
    layout: str = "bshd",
) -> None:
    """Quantize new K (and V) states into a paged FP8 cache, in place.

    Token j of sequence b (global token ``cu_seqlens_q[b] + j``) goes to position
    ``pos = kv_seqlens[b] - q_len_b + j``: block ``block_offsets[b, pos // block_size]``,
    slot ``pos % block_size``; quantized per (token, head, group of ``group_size`` columns).

    Args:
        k_states: ``[N_tok, H_kv, D]`` bf16, fp16 or f32.
        v_states: ``[N_tok, H_kv, Dv]`` (same dtype) or ``None`` (K-only cache, e.g. MLA's latent
            cache; every column of ``k_states`` is quantized, so a rope part meant to stay in 16
            bits, as in FlashMLA's FP8 cache, is the caller's to store).
        k_cache: float8_e4m3fn, ``[num_blocks, block_size, H_kv, D]`` (``"bshd"``) or
            ``[num_blocks, H_kv, block_size, D]`` (``"bhsd"``), ``block_size >= 1``, no two
            elements at one address (no ``expand``). Mutated.
        v_cache: same with Dv, or ``None``; not starting at k_cache's address. Mutated.
        k_scale_cache, v_scale_cache: f32, the cache layout with last dim ``D/group_size``. Mutated.
        cu_seqlens_q: ``[B+1]`` int32 prefix sums of the new tokens per sequence (``[-1] == N_tok``,
            not checked): non-decreasing (``ValueError`` on the CPU, and on the GPU under
            ``CUTE_MOE_DEBUG=1``; unchecked there otherwise).
        kv_seqlens: ``[B]`` int32 sequence lengths **including** the new tokens (lmdeploy's
            ``kv_seqlens``, vLLM's ``seq_lens``; a context length without them, such as vLLM's
            ``context_lens``, puts the tokens that many slots too early).
        block_offsets: ``[B, max_blocks]`` int32 block table.
        group_size: must divide D (and Dv); on the GPU a power of two in ``[32, 1024]``
            (``NotImplementedError`` otherwise).
        scale_fmt: ``None`` or ``"ue8m0"``.
        layout: ``"bshd"`` or ``"bhsd"``.

    ``v_states``, ``v_cache`` and ``v_scale_cache`` are all None or all tensors.
    Nothing is written for a token before ``cu_seqlens_q[0]`` or past ``cu_seqlens_q[-1]`` (in
    no sequence), a negative position, a block index past ``max_blocks`` or a block id outside
    ``[0, num_blocks)``: the kernel never writes out of bounds. Two tokens sent to one slot (a
    block id shared between sequences) are outside the contract: which token's codes and scales
    the slot ends with is unspecified. With ``CUTE_MOE_DEBUG=1`` the CUDA path checks every entry
    of ``block_offsets`` on the host (a device sync) and raises ``ValueError`` for one outside
    ``[-1, num_blocks)``; -1 entries are still skipped.
    Inputs must be finite (non-finite values give unspecified codes).
    """
    _dispatch(
        "fill_kv_cache_fp8", k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache, cu_seqlens_q,
        kv_seqlens, block_offsets, group_size, scale_fmt, layout,
    )  # fmt: skip
