"""Host-side checks and output allocation the kernels' launch functions share (no cutlass
import, no data read unless ``CUTE_MOE_DEBUG=1`` asks for it).

Allocations pass sizes as separate ints, never a shape tuple: on the H200 machine's host
``torch.empty((m, n), ...)`` takes 3.5 µs and ``torch.empty(m, n, ...)`` 1.9 µs.

The op layer (``cute_moe.validation``) owns the contract's rules; these are the kernels'
own: the 16-byte rows their vector loads need, and the index ranges (on the CPU where the
references would index out of range with them; on the GPU in debug mode only, where the kernels
skip such entries; fill_kv_cache_fp8's block ids, which its reference skips too, in debug mode
only on either).
"""
from __future__ import annotations

import os

import torch

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y


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


def debug_checks() -> bool:
    """``CUTE_MOE_DEBUG=1``: the CUDA implementations check their index data as the CPU ones always
    do, at the cost of a device sync (never replayed by the launch memo)."""
    return os.environ.get("CUTE_MOE_DEBUG") == "1"


def check_index_range(op: str, name: str, t: torch.Tensor | None, lo: int, hi: int) -> None:
    """ValueError unless every entry of ``t`` lies in [lo, hi), naming the first that does not.  It
    reads ``t``: on a GPU a device sync, so the CUDA paths call it only under ``debug_checks``."""
    if t is None or not t.numel():
        return
    # Bounds clamped into the dtype's range (compared in it, one past the range would wrap).
    info = torch.iinfo(t.dtype)
    bad = (t < max(lo, info.min)) | (t > min(hi - 1, info.max))
    if bool(bad.any()):
        at = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"cute_moe.{op}: {name} entries must lie in [{lo}, {hi}), got {int(t[at])} at {at}")


def debug_check_index_range(op: str, name: str, t: torch.Tensor, upper: int) -> None:
    """With ``CUTE_MOE_DEBUG=1``: ``check_index_range`` over [-1, upper).  Off by default: the
    kernels skip such entries instead of reading or writing out of bounds."""
    if debug_checks():
        check_index_range(op, name, t, -1, upper)
