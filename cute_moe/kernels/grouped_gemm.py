"""grouped_gemm_fp8's CUDA entry point: the kernel for the device's architecture.

``sm_90a`` (H100/H200): ``grouped_gemm_sm90`` — run and checked on an H200.
``sm_100a`` (B200/GB200): ``grouped_gemm_sm100`` — compiled and SASS-inspected only, **never run
on hardware** (no Blackwell GPU was available), and its first use in a process warns so;
``tests/test_gpu_grouped_gemm_sm100.py`` is its acceptance test on the first B200.  Other
architectures raise ``NotImplementedError``.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..compiler import arch_of_device_index


_sm100_warned = False


@functools.cache
def _arch_launcher(arch: str):
    """The launch function of ``arch``'s kernel, imported on first use (and kept: patching the
    kernel module's function afterwards does not reach this entry point)."""
    if arch == "sm_90a":
        from .grouped_gemm_sm90 import grouped_gemm_fp8_cuda

        return grouped_gemm_fp8_cuda
    if arch == "sm_100a":
        from .grouped_gemm_sm100 import grouped_gemm_fp8_sm100_cuda

        global _sm100_warned
        if not _sm100_warned:  # once, even where warnings are errors (the cache keeps no exception)
            _sm100_warned = True
            warnings.warn(
                "cute_moe.grouped_gemm_fp8: the sm_100a kernel is compiled and SASS-checked only and has never "
                "run on hardware; tests/test_gpu_grouped_gemm_sm100.py is its acceptance test",
                stacklevel=2,
            )

        # It computes every row, so it takes no expert_counts.
        return lambda a, a_scale, b, b_scale, offsets, _, *, expected_m, op: grouped_gemm_fp8_sm100_cuda(
            a, a_scale, b, b_scale, offsets, op=op)  # fmt: skip
    raise NotImplementedError(f"cute_moe.grouped_gemm_fp8: no kernel for {arch}")


def grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets, expert_counts=None, expected_m=None,
                          op: str = "grouped_gemm_fp8") -> torch.Tensor:  # fmt: skip
    """``expert_counts`` lets the sm_90a kernel skip warp groups of pure padding and leave the
    padding rows of a tile with at most 64 real rows unwritten; the sm_100a kernel computes every
    row.  Either way padding rows of the output are unspecified: without counts they are zero when
    A's padding rows are (``permute_quant``'s default), anything when those were left unwritten.
    ``expected_m``: rows per expert the sm_90a launch rule assumes (the sm_100a kernel has one tile
    shape).  ``op``: the op the launch's errors name."""
    return _arch_launcher(arch_of_device_index(a.get_device()))(a, a_scale, b, b_scale, expert_offsets, expert_counts,
                                                                expected_m=expected_m, op=op)  # fmt: skip


def inspect_variants(arch: str):
    from . import grouped_gemm_sm90, grouped_gemm_sm100

    return grouped_gemm_sm90.inspect_variants(arch) + grouped_gemm_sm100.inspect_variants(arch)
