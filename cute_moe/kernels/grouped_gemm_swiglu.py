"""grouped_gemm_fp8_swiglu's CUDA entry point: the w13 GEMM with ``silu_mul_quant`` in its epilogue.

``sm_90a``, where ``grouped_gemm_schedule.sm90_swiglu_tile`` gives a tile width: one kernel,
``grouped_gemm_sm90.grouped_gemm_fp8_swiglu_cuda``.  256 wide where the GEMM takes that tile (about
one real M tile per expert or more, from ``expected_m`` where given; without it, with expert counts,
also at least 64 experts): the tile's halves hold a gate block and its up block.  128 wide where
the GEMM's 128-wide tile pairs N tiles (decode sizes; K <= 2048 under one real M tile per expert):
a tile holds 64 gate and 64 up columns, and the cluster pair's two tiles one 1x128 group.
Everywhere else ``grouped_gemm_fp8``'s kernel and then ``silu_mul_quant``'s: sm_100a; on sm_90a
where the 128-wide GEMM stores behind 2.25 or more M tiles of rows per expert by M_cap's estimate
(K <= 2048, under 64 experts without ``expected_m``), quicker than the fused kernel's register
stores where measured, and a 128-wide launch paired along M, which the rules never choose.  The
results are the same bits.
"""
from __future__ import annotations

import torch

from ..compiler import arch_of_device_index
from .grouped_gemm_schedule import sm90_swiglu_tile

_OP = "grouped_gemm_fp8_swiglu"


def grouped_gemm_fp8_swiglu_cuda(a, a_scale, w13, w13_scale, expert_offsets, expert_counts=None, gate_first=True,
                                 scale_fmt=None, expected_m=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if arch_of_device_index(a.get_device()) == "sm_90a":
        tile_n = sm90_swiglu_tile(a.shape[0], w13.shape[0], a.shape[1], expert_counts is not None, expected_m)
        if tile_n is not None:
            from .grouped_gemm_sm90 import grouped_gemm_fp8_swiglu_cuda as fused  # noqa: PLC0415

            return fused(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first, scale_fmt, expected_m,
                         tile_n)  # fmt: skip
    from .grouped_gemm import grouped_gemm_fp8_cuda  # noqa: PLC0415
    from .silu_mul_quant import silu_mul_quant_cuda  # noqa: PLC0415

    h = grouped_gemm_fp8_cuda(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, expected_m, op=_OP)
    return silu_mul_quant_cuda(h, expert_offsets, gate_first, scale_fmt, expert_counts)


def inspect_variants(arch: str):
    """sm_90a: the fused kernel's variants with expert counts, as fused_moe runs them (256 wide at
    prefill, 128 wide at decode; where the op runs two kernels, those are listed under
    ``grouped_gemm_fp8`` and ``silu_mul_quant``).  sm_100a, which has no fused kernel: the two
    kernels the op runs."""
    if arch == "sm_90a":
        from . import grouped_gemm_sm90  # noqa: PLC0415

        return grouped_gemm_sm90.inspect_swiglu_variants(arch)
    from . import grouped_gemm, silu_mul_quant  # noqa: PLC0415

    return grouped_gemm.inspect_variants(arch) + silu_mul_quant.inspect_variants(arch)
