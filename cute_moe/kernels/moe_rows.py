"""Device pieces shared by the kernels that walk the rows of an MoE layout
(``permute_quant``, ``permute``, ``silu_mul_quant``).

* ``RowGroupKernel``: the CTA shape they share.  One (row, group of 128
  columns) is handled by ``lanes`` consecutive lanes owning 16 bytes of input
  each; 256 threads, 4 rows per thread; the grid is ``(groups, row blocks)``
  with group columns fastest and a grid-stride loop past 65535 row blocks.
* ``rows_end``: the first row past the last expert segment, read on the device
  from ``expert_offsets[-1]`` (clamped to the buffer's ``M_cap`` rows), so the
  host never synchronises and the grid is sized from the static ``M_cap``.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .fp8_group import lanes_per_group, quantize_group_fp8
from .host_checks import check_rows_16b

GROUP = 128
MAX_GRID_Y = 65535


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


def checked_outputs(op: str, name: str, src: torch.Tensor, reason, rows: int, cols: int):
    """Host side of a launch: refuse what the kernel cannot do (``reason`` from its
    ``can_implement``), check ``src``'s 16-byte rows, and allocate the outputs: codes
    [rows, cols] e4m3 and MN-major f32 scales [rows, cols / 128] (strides (1, rows))."""
    if reason is not None:
        raise NotImplementedError(f"cute_moe.{op}: no CUDA kernel for this input: {reason}")
    check_rows_16b(op, name, src)
    codes = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=src.device)
    scales = torch.empty((cols // GROUP, rows), dtype=torch.float32, device=src.device).t()
    return codes, scales
