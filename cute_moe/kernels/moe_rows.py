"""Device pieces shared by the kernels that walk the rows of an MoE layout
(``permute_quant``, ``permute``, ``silu_mul_quant``).

* ``RowGroupKernel``: the CTA shape they share.  One (row, group of 128
  columns) is handled by ``lanes`` consecutive lanes owning 16 bytes of input
  each; 256 threads, 4 rows per thread; the grid is ``(groups, row blocks)``
  with group columns fastest and a grid-stride loop past 65535 row blocks.
* ``rows_end``: the first row past the last expert segment, read on the device
  from ``expert_offsets[-1]`` (clamped to the buffer's ``M_cap`` rows), so the
  host never synchronises and the grid is sized from the static ``M_cap``.
* ``or_sign_bits``: gives every FP8 code the sign bit of its input.  The shared
  quantizer's residual step (``fp8_group.quantize_group_fp8``, scale_fmt None)
  computes ``x / scale`` as ``q0 + (x - scale*q0) / scale``, whose sum of two
  zeros is +0 in round-to-nearest, so an input of -0.0 comes out as code 0x00
  where the reference (true division) writes -0.0, code 0x80.  The sign of
  ``x / scale`` is the sign of ``x`` (scale > 0) for every input, so OR-ing the
  input's sign bit into the code's bit 7 is exact: it changes -0.0 inputs only.
  silu(g) * u is -0.0 whenever silu(g) is (g < -88.72 divides by +inf), which
  is common in large activations, so there the fix is not optional.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass.cute.nvgpu import cpasync

from .fp8_group import lanes_per_group, quantize_group_fp8

GROUP = 128
MAX_GRID_Y = 65535
_SIGN_BYTES = 0x80808080


class RowGroupKernel:
    """Static CTA shape for groups of 128 columns of 16-byte lanes (see the module docstring)."""

    num_threads = 256
    rows_per_thread = 4

    def __init__(self, elem_bytes: int):
        self.lanes = lanes_per_group(elem_bytes, GROUP)
        self.elems_per_lane = GROUP // self.lanes
        self.rows_per_pass = self.num_threads // self.lanes
        self.rows_per_cta = self.rows_per_pass * self.rows_per_thread

    @cute.jit
    def grid(self, mOut: cute.Tensor):
        """(groups, row blocks of M_cap, clamped to the grid's y limit)."""
        grid_y = cute.ceil_div(mOut.shape[0], self.rows_per_cta)
        if grid_y > MAX_GRID_Y:
            grid_y = Int32(MAX_GRID_Y)
        return [mOut.shape[1] // GROUP, grid_y, 1]

    @cute.jit
    def coords(self, mOff: cute.Tensor, mOut: cute.Tensor):
        """(tidx, group, first row block, row-block stride, end, this lane's 16-byte chunk)."""
        tidx, _, _ = cute.arch.thread_idx()
        group, bidy, _ = cute.arch.block_idx()
        _, grid_y, _ = cute.arch.grid_dim()
        return tidx, group, bidy, grid_y, rows_end(mOff, mOut.shape[0]), group * self.lanes + tidx % self.lanes

    def load_16b_async(self, dtype):
        """cp.async of 16 bytes, L2 only (streamed data)."""
        return cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128
        )

    def thread_slots(self, count: int):
        """Layout of ``count`` 16-byte slots per thread in shared memory: (elements, thread, slot),
        consecutive threads' slots adjacent, so 16-byte shared loads are conflict-free."""
        return cute.make_layout(
            (self.elems_per_lane, self.num_threads, count),
            stride=(1, self.elems_per_lane, self.elems_per_lane * self.num_threads),
        )

    @cute.jit
    def quantize_store(self, rX, mQ, mS, row, end, group, chunk, tidx, ue8m0: cutlass.Constexpr):
        """Quantize this lane's share of (row, group) and store codes and scale when row < end.

        Every lane calls it, whatever its row (the group's amax is a shuffle reduction)."""
        rQ = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Float8E4M3FN)
        scale = quantize_group_fp8(rX, rQ, self.lanes, ue8m0)
        if cutlass.const_expr(not ue8m0):
            or_sign_bits(rX, rQ)  # -0.0 -> code 0x80, as the reference's true division
        if row < end:
            store = cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=8 * self.elems_per_lane
            )
            cute.copy(store, rQ, cute.local_tile(mQ[row, None], (self.elems_per_lane,), (chunk,)))
            if tidx % self.lanes == 0:
                mS[row, group] = scale


@cute.jit
def rows_end(mOff: cute.Tensor, num_rows) -> Int32:
    """min(expert_offsets[-1], num_rows)."""
    end = mOff[mOff.shape[0] - 1]
    if end > num_rows:
        end = num_rows
    return end


@cute.jit
def or_sign_bits(rX: cute.Tensor, rQ: cute.Tensor):
    """rQ (registers, n FP8 codes) |= sign bits of rX (registers, n values of 16 or 32 bits).

    PRMT gathers the most significant bytes of four inputs (their sign bits are those
    bytes' bit 7) and one LOP3 merges them into four codes.
    """
    n = cute.size(rQ)
    words = cute.recast_tensor(rQ, Uint32)
    src = cute.recast_tensor(rX, Uint32)
    for w in cutlass.range_constexpr(n // 4):
        if cutlass.const_expr(rX.element_type.width == 16):  # two values per word: bytes 1 and 3
            signs = cute.arch.prmt(src[2 * w], src[2 * w + 1], Int32(0x7531))
        else:  # one value per word: byte 3
            lo = cute.arch.prmt(src[4 * w], src[4 * w + 1], Int32(0x0073))
            hi = cute.arch.prmt(src[4 * w + 2], src[4 * w + 3], Int32(0x7300))
            signs = cute.arch.prmt(lo, hi, Int32(0x7610))
        words[w] = words[w] | (Uint32(signs) & Uint32(_SIGN_BYTES))

