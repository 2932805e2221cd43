"""grouped_gemm_fp8's CUDA entry point: the kernel for the device's architecture.

``sm_90a`` (H100/H200): ``grouped_gemm_sm90`` — run and checked on an H200.
``sm_100a`` (B200/GB200): ``grouped_gemm_sm100`` — compiled and SASS-inspected only, **never run
on hardware** (no Blackwell GPU was available); ``tests/test_gpu_grouped_gemm_sm100.py`` is its
acceptance test on the first B200.  Other architectures raise ``NotImplementedError``.
"""
from __future__ import annotations

import torch

from ..compiler import arch_of_device


def grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets, expert_counts=None) -> torch.Tensor:
    """``expert_counts`` lets the sm_90a kernel skip warp groups of pure padding; the sm_100a kernel
    computes every row.  Either way padding rows of the output are unspecified: zero when A's
    padding rows are (``permute_quant``'s default), anything when they were left unwritten."""
    arch = arch_of_device(a.device)
    if arch == "sm_90a":
        from .grouped_gemm_sm90 import grouped_gemm_fp8_cuda as launch

        return launch(a, a_scale, b, b_scale, expert_offsets, expert_counts)
    if arch == "sm_100a":
        from .grouped_gemm_sm100 import grouped_gemm_fp8_sm100_cuda as launch

        return launch(a, a_scale, b, b_scale, expert_offsets)
    raise NotImplementedError(f"cute_moe.grouped_gemm_fp8: no kernel for {arch}")


def inspect_variants(arch: str):
    from . import grouped_gemm_sm90, grouped_gemm_sm100

    return grouped_gemm_sm90.inspect_variants(arch) + grouped_gemm_sm100.inspect_variants(arch)
