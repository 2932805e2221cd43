"""grouped_gemm_fp8_swiglu's CUDA entry point: the w13 GEMM with ``silu_mul_quant`` in its epilogue.

``sm_90a``: ``grouped_gemm_sm90.grouped_gemm_fp8_swiglu_cuda`` (the 256-wide tile's halves hold a
gate block and its up block).  Other architectures run ``grouped_gemm_fp8``'s kernel and then
``silu_mul_quant``'s, the same two steps as before the fusion.
"""
from __future__ import annotations

import torch

from ..compiler import arch_of_device_index


def grouped_gemm_fp8_swiglu_cuda(a, a_scale, w13, w13_scale, expert_offsets, expert_counts=None, gate_first=True,
                                 scale_fmt=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if arch_of_device_index(a.get_device()) == "sm_90a":
        from .grouped_gemm_sm90 import grouped_gemm_fp8_swiglu_cuda as fused  # noqa: PLC0415

        return fused(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first, scale_fmt)
    from .grouped_gemm import grouped_gemm_fp8_cuda  # noqa: PLC0415
    from .silu_mul_quant import silu_mul_quant_cuda  # noqa: PLC0415

    h = grouped_gemm_fp8_cuda(a, a_scale, w13, w13_scale, expert_offsets, expert_counts)
    return silu_mul_quant_cuda(h, expert_offsets, gate_first, scale_fmt, expert_counts)


def inspect_variants(arch: str):
    """sm_90a: the fused kernel's variants.  Elsewhere the op is the two kernels: theirs, so that
    ``python -m cute_moe.inspect grouped_gemm_fp8_swiglu`` lists what runs on every architecture."""
    if arch == "sm_90a":
        from . import grouped_gemm_sm90  # noqa: PLC0415

        return grouped_gemm_sm90.inspect_swiglu_variants(arch)
    from . import grouped_gemm, silu_mul_quant  # noqa: PLC0415

    return grouped_gemm.inspect_variants(arch) + silu_mul_quant.inspect_variants(arch)
