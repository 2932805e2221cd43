"""What the demo (``python -m cute_moe``), the GPU tests and the benchmarks share to build and check
a full-size MoE layer: random FP8 expert weights, and the layer's f32 reference computed per
touched expert on the GPU.

``reference_moe`` is the math of ``reference.fused_moe_routed_ref`` (activations quantized to e4m3
with 1x128 f32 scales as ``permute_quant`` / ``silu_mul_quant`` do, GEMM outputs rounded to bf16 as
the kernels write them, SwiGLU in f32, the weighted sum in f32 in slot order, one bf16 rounding)
with IEEE f32 matmuls instead of the exact per-128-block sums of ``grouped_gemm_fp8_ref``, which
would take minutes at DeepSeek-V3's size; only the touched experts' weights are dequantized, one
expert at a time.  The two differ by f32 rounding in the GEMMs: a few 1e-4 after the bf16 and
e4m3 roundings (``tests/test_gpu_fused_moe.py`` checks it).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from . import reference as R

BLOCK = R.BLOCK
CODE_STD = 100.0  # std of the random e4m3 codes: the max |code| of a 128x128 block is ~4.2 std ~ 448


def random_fp8_experts(E: int, N: int, K: int, g: torch.Generator,
                       device: str | torch.device = "cuda") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(codes e4m3 [E, N, K], block scales f32 [E, N/128, K/128]) drawn directly on ``device``.

    Codes ~ N(0, CODE_STD) clamped to +-448 (the whole e4m3 range, as amax/448 block scaling
    leaves a checkpoint), generated in chunks of 2**28 (1 GB of f32); scales put the dequantized
    weights at std ~K^-0.5 with a per-block spread of 10**U(-0.3, 0.3), so a wrong block scale
    shows.  Built directly: quantizing DeepSeek-V3's 11 GB of bf16 weights would take far longer."""
    if N % BLOCK or K % BLOCK:
        raise ValueError(f"random_fp8_experts: N and K must be multiples of {BLOCK}, got {N} and {K}")
    codes = torch.empty(E, N, K, dtype=R.FP8_DTYPE, device=device)
    flat = codes.view(-1)
    step = 1 << 28
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        flat[i : i + n].copy_(torch.randn(n, generator=g, device=device).mul_(CODE_STD).clamp_(-448.0, 448.0))
    spread = torch.pow(10.0, torch.empty(E, N // BLOCK, K // BLOCK, device=device).uniform_(-0.3, 0.3, generator=g))
    return codes, spread * (K**-0.5 / CODE_STD)


def quant_dequant_rows(v: torch.Tensor, scale_fmt: Optional[str] = None) -> torch.Tensor:
    """f32 [rows, K]: ``v`` through the 1x128 activation quantizer (``reference.quant_fp8_ref``) and back."""
    q, s = R.quant_fp8_ref(v, BLOCK, scale_fmt)
    rows, K = v.shape
    return q.float().view(rows, K // BLOCK, BLOCK).mul_(s[:, :, None]).view(rows, K)


@contextlib.contextmanager
def ieee_f32_matmul():
    """f32 matmuls in full f32 (no TF32), whatever the session set."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def reference_moe(x, topk_ids, topk_weights, w13, s13, w2, s2, *, expert_offset: int = 0,
                  gate_first: bool = True, act_scale_fmt: Optional[str] = None,
                  apply_router_weight_on_input: bool = False) -> torch.Tensor:  # fmt: skip
    """bf16 [T, H]: the layer of ``reference.fused_moe_routed_ref`` (the module docstring), per
    touched local expert (ids outside ``[expert_offset, expert_offset + E_local)`` contribute
    nothing), dequantizing only those experts' weights, one expert at a time."""
    T, H = x.shape
    k = topk_ids.shape[1]
    e_local, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return out.to(torch.bfloat16)
    if apply_router_weight_on_input:  # slot (t, j) sees x[t] * bf16(w[t, j]); its output is unweighted
        scaled = (x[:, None, :] * topk_weights.to(x.dtype)[:, :, None]).reshape(T * k, H)
        xd, per_slot = quant_dequant_rows(scaled, act_scale_fmt), True
        topk_weights = torch.ones_like(topk_weights)
    else:
        xd, per_slot = quant_dequant_rows(x, act_scale_fmt), False
    local = topk_ids.reshape(-1).long() - expert_offset
    key = torch.where((local >= 0) & (local < e_local), local, e_local)  # e_local = not local
    order = torch.argsort(key, stable=True)  # slots t*k + j grouped by local expert
    counts = torch.zeros(e_local + 1, dtype=torch.long, device=x.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key)).tolist()
    y = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)  # GEMM2 output per slot (0: not local)
    start = 0
    with ieee_f32_matmul():
        for e in range(e_local):
            sel = order[start : start + counts[e]]
            start += counts[e]
            if sel.numel() == 0:
                continue
            rows = xd[sel] if per_slot else xd[sel // k]
            h = (rows @ R.dequant_block_128x128_ref(w13[e], s13[e]).t()).to(torch.bfloat16).float()
            first, second = h[:, :inter], h[:, inter:]
            gate, up = (first, second) if gate_first else (second, first)
            a2 = quant_dequant_rows(F.silu(gate) * up, act_scale_fmt)
            y[sel] = (a2 @ R.dequant_block_128x128_ref(w2[e], s2[e]).t()).to(torch.bfloat16).float()
    y = y.view(T, k, H)
    for j in range(k):  # f32, in slot order, as finalize
        out = out + topk_weights[:, j, None].float() * y[:, j]
    return out.to(torch.bfloat16)
