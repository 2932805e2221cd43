"""Host-side checks and output allocation the kernels' launch functions share (no cutlass
import, no data read unless ``CUTE_MOE_DEBUG=1`` asks for it).

Allocations pass sizes as separate ints, never a shape tuple: on the H200 machine's host
``torch.empty((m, n), ...)`` takes 3.5 µs and ``torch.empty(m, n, ...)`` 1.9 µs.

The op layer (``cute_moe.validation``) owns the contract's rules; these are the kernels'
own: the 16-byte rows their vector loads need, and, in debug mode, the index ranges the
kernels would otherwise skip silently.
"""
from __future__ import annotations

import os

import torch


def check_rows_16b(op: str, name: str, t: torch.Tensor) -> None:
    """ValueError unless the last stride is 1 and the base and every other stride (of dims of
    size > 1) are multiples of 16 bytes: each lane's 16-byte vector loads stay aligned."""
    item = t.element_size()
    if (
        t.stride(-1) != 1
        or t.data_ptr() % 16
        or any((t.stride(d) * item) % 16 for d in range(t.dim() - 1) if t.shape[d] > 1)
    ):
        raise ValueError(
            f"cute_moe.{op}: {name} needs a unit last stride, a 16-byte aligned base and other strides "
            f"that are multiples of 16 bytes, got strides {tuple(t.stride())} of {item}-byte elements"
        )


def empty_mn_major(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """f32 [rows, cols] with strides (1, max(rows, 1)): the MN-major scale layout, with the strides
    of ``torch.empty(cols, rows).t()`` (what the ops' fake implementations promise) in one call."""
    return torch.empty_strided((rows, cols), (1, max(rows, 1)), dtype=torch.float32, device=device)


def debug_check_index_range(op: str, name: str, t: torch.Tensor, upper: int) -> None:
    """With ``CUTE_MOE_DEBUG=1``: ValueError unless every entry of ``t`` is -1 or in [0, upper).

    A host check that reads ``t`` (a device sync), so off by default: the kernels skip such
    entries instead of reading or writing out of bounds.
    """
    if os.environ.get("CUTE_MOE_DEBUG") != "1":
        return
    bad = (t < -1) | (t >= upper)
    if bool(bad.any()):
        raise ValueError(
            f"cute_moe.{op}: {name} holds entries outside [-1, {upper}) "
            f"(first at {tuple(bad.nonzero()[0].tolist())}); the kernel would skip them"
        )
