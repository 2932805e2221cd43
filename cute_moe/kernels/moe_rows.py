"""Device pieces shared by the kernels that walk the rows of an MoE layout
(``permute_quant``, ``permute``, ``silu_mul_quant``).

* ``RowGroupKernel``: the row-major gathers' CTA shape.  One (row, group of 128
  columns) is handled by ``lanes`` consecutive lanes owning 16 bytes of input
  each; 256 threads, 4 rows per thread; the grid is ``(groups, row blocks)``
  with group columns fastest and a grid-stride loop past 65535 row blocks.
* ``rows_end``: the first row past the last expert segment, read on the device
  from ``expert_offsets[-1]`` (clamped to the buffer's ``M_cap`` rows), so the
  host never synchronises and the grid is sized from the static ``M_cap``.
* ``real_rows_end``: with ``align``'s ``expert_counts``, the end of the real
  (routed) rows of the segment holding a block of rows, found by the whole CTA in
  one round of loads (see its docstring): rows of the block at or past it are padding.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .fp8_group import lanes_per_group, quantize_group_fp8
from .host_checks import MAX_GRID_Y, check_rows_16b, empty_mn_major

GROUP = 128


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

    def thread_slots(self, count: int):
        return thread_slots(self.elems_per_lane, self.num_threads, count)

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


def load_16b_async(dtype):
    """cp.async of 16 bytes, L2 only (streamed data)."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype, num_bits_per_copy=128)


def thread_slots(elems: int, num_threads: int, count: int):
    """Layout of ``count`` 16-byte slots of ``elems`` elements per thread in shared memory:
    (elements, thread, slot), consecutive threads' slots adjacent, so 16-byte shared loads are
    conflict-free."""
    return cute.make_layout((elems, num_threads, count), stride=(1, elems, elems * num_threads))


@cute.jit
def rows_end(mOff: cute.Tensor, num_rows) -> Int32:
    """expert_offsets[-1] clamped to [0, num_rows] (a negative end, outside the contract, writes
    nothing rather than being read as a huge unsigned bound)."""
    end = mOff[mOff.shape[0] - 1]
    if end > num_rows:
        end = num_rows
    if end < 0:
        end = Int32(0)
    return end


@cute.jit
def real_rows_end(mOff: cute.Tensor, mCnt: cute.Tensor, first_row: Int32, last_row: Int32, end: Int32,
                  sWarp: cute.Tensor, tidx: Int32, num_threads: cutlass.Constexpr) -> Int32:  # fmt: skip
    """With ``align``'s counts: the rows of the block ``[first_row, last_row]`` to process are those
    below the returned bound (``<= end``); the rest are padding.

    The segment ``e`` with ``off[e] <= first_row < off[e + 1]`` holds the block when also
    ``last_row < off[e + 1]`` (always so when segments are multiples of 128 rows and the block's
    rows divide 128): the bound is ``off[e] + min(counts[e], off[e + 1] - off[e])``.  A block that
    straddles segment ends (a routing aligned to fewer rows) gets ``end``: every row processed, as
    without counts.  No segment holds ``first_row`` (rows before ``off[0]``): 0, nothing processed.

    Found by the whole CTA of ``num_threads`` threads: thread t looks at segment t (then t +
    num_threads, ... for larger E) with its three loads issued before the first compare (one memory
    round trip), a warp's bound is one ``redux.sync``, the CTA's the max of the warps' (``sWarp``:
    one Int32 per warp in shared memory) after one barrier, so every thread of the CTA must call
    it.  About 40 instructions per thread, where one warp scanning all E = 256 segments costs
    ~150.  The result is CTA-uniform; nothing is read out of bounds, whatever the data.
    """
    num_experts = mOff.shape[0] - 1
    bound = Int32(0)
    for base in cutlass.range(0, num_experts, num_threads, unroll=1):
        e = base + tidx
        if e < num_experts:
            lo, hi, cnt = mOff[e], mOff[e + 1], mCnt[e]
            seg = cutlass.select_(last_row < hi, lo + min(cnt, hi - lo), end)
            bound = max(bound, cutlass.select_(lo <= first_row and first_row < hi, seg, 0))
    bound = cute.arch.warp_redux_sync(bound, "max")
    if tidx % 32 == 0:
        sWarp[tidx // 32] = bound
    cute.arch.sync_threads()
    for w in cutlass.range_constexpr(num_threads // 32):
        bound = max(bound, sWarp[w])
    return cute.arch.make_warp_uniform(min(bound, end))


def processed_rows(offsets: list[int], counts: list[int] | None, m_cap: int, rows_per_cta: int) -> list[int]:
    """The rows ``silu_mul_quant`` loads and stores, ascending: the executable model of ``rows_end``
    and ``real_rows_end`` over its blocks of rows (tested on the CPU).  Without counts,
    every row below ``end = min(off[-1], m_cap)``; with counts, per block of ``rows_per_cta`` rows,
    those below ``real_rows_end``'s bound."""
    end = max(min(offsets[-1], m_cap), 0)
    if counts is None:
        return list(range(end))
    rows = []
    for first in range(0, end, rows_per_cta):
        last = min(first + rows_per_cta, end) - 1
        bound = 0
        for e in range(len(counts)):
            lo, hi = offsets[e], offsets[e + 1]
            if lo <= first < hi:
                seg = end if last >= hi else lo + min(counts[e], hi - lo)
                bound = max(bound, seg)
        rows += range(first, min(max(bound, first), end, first + rows_per_cta))
    return rows


def checked_outputs(op: str, name: str, src: torch.Tensor, reason, rows: int, cols: int):
    """Host side of a launch: refuse what the kernel cannot do (``reason`` from its
    ``can_implement``), check ``src``'s 16-byte rows, and allocate the outputs: codes
    [rows, cols] e4m3 and MN-major f32 scales [rows, cols / 128] (strides (1, rows))."""
    if reason is not None:
        raise NotImplementedError(f"cute_moe.{op}: no CUDA kernel for this input: {reason}")
    check_rows_16b(op, name, src)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=src.device)
    scales = empty_mn_major(rows, cols // GROUP, src.device)
    return codes, scales
