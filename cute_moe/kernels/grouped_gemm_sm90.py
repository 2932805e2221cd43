"""Hopper (sm_90a) grouped FP8 GEMM with 1x128 / 128x128 block scales.

Math (``reference.grouped_gemm_fp8_ref``): for every row ``r`` of expert ``e``'s
segment ``[off[e], off[e+1])`` and column ``n``::

    C[r, n] = sum_kb  a_scale[r, kb] * b_scale[e, n // 128, kb]
                      * sum_{k in block kb} A[r, k] * B[e, n, k]      (f32), bf16 out

Each 128-wide K block's FP8 product is accumulated by WGMMA into a temporary f32
accumulator, then promoted into the running f32 accumulator with the block's two
scales (promotion in f32 by the CUDA cores, never in the tensor core's accumulator).

Pipeline (persistent: one CTA per SM, 384 threads, clusters of 2 CTAs; schedule in
``grouped_gemm_schedule``).  The cluster's direction is a compile-time choice, made per launch
from the shapes by ``sm90_launch_config`` (``cluster_along_m``):
* pairs along N (default; ``tile_schedule``): N tiles 2j and 2j + 1 of one M tile, N fastest.
  Each CTA loads half of the A tile and multicasts it to both.
* pairs along M (prefill MoE: long K, >= 64 experts of 2-6 M tiles each, 1-6 with the 256-wide
  tile, which also pairs contiguous segments of any expert count so, and any expert count given the
  op's ``expected_m``; ``pair_tile_schedule``): M tiles
  2i and 2i + 1 of one N tile, in bands of ``PAIRS_PER_BAND`` pairs.  When both are expert
  ``e``'s, each CTA loads half of the B tile and multicasts it to both, so that the expert's
  weights are read once per pair of M tiles; with so few M tiles per expert the weights' DRAM
  re-reads otherwise bound the kernel.  A pair across two experts loads B per CTA.

With ``swiglu`` (``grouped_gemm_fp8_swiglu``, where ``sm90_swiglu_tile`` gives a width) the kernel is
the w13 GEMM with ``silu_mul_quant`` in its epilogue, which writes ``y = silu(gate) * up`` as FP8
codes with 1x128 scales, bit for bit what the two kernels write:
* 256 wide (prefill): the tile's halves are gate block j and up block j of w13, one 1x128 group per
  row (``swiglu_epilogue``: through shared memory, one TMA store per tile);
* 128 wide (decode sizes, and K <= 2048 under a real M tile per expert; pairs along N only, no
  store-behind): the tile holds w13's gate rows
  [64 t, 64 t + 64) and the matching up rows, B loaded as two 64-row boxes with one B scale each
  (the promotion takes a column's scale by its half), so a thread holds both factors of each of
  its output columns; a row's 1x128 group spans the pair's N tiles 2j and 2j + 1, and the two CTAs
  exchange each row's amax over their 64 columns by ``st.async`` into each other's shared memory
  (``pair_swiglu_epilogue``) before both quantize with the group's.  The codes leave from registers.
  This keeps the 128-wide GEMM's decode schedule, where the 256-wide tile lost 1-4% (session 26),
  and drops the bf16 h round trip and the second launch.

The tile's width is the other compile-time choice (``wide_tile``): 128 x 128, or 128 x 256 at
prefill sizes.  The wide tile costs a quarter fewer operand bytes per FLOP through L2 and TMA; it
has room for 4 stages only (3 beside the store-behind epilogue), and its math goes by halves (below).

* warp 0 (TMA): per K block, the A tile (128 x 128) and expert ``e``'s B tile
  (``tile_n`` x 128) into one of the shared-memory stages (``PipelineTmaAsync``), each by one
  load or by halves multicast within the cluster as above.  With expert counts, pairs along N and
  no store-behind epilogue (DeepSeek-V3's w13 GEMM; its w2 at decode sizes, under half a real M
  tile per expert, T < 2048, and 256 wide below 1.5, T < 6144) only A's first 16, 64 or 128 rows (``A_BOX_ROWS``), the first box that holds the tile's real rows, looked up with the visit's expert; the rest of the stage keeps older
  rows, which reach only accumulator rows that are never stored.  At decode A's 128-row tile was
  half of what a CTA read per K block (from L2) for a row or two of it.
* warp 1 (scales): per K block, ``cp.async`` of the tile's 128 A scales (MN-major,
  so 512 contiguous bytes: 16 per lane) and its one B scale (two for a 256-wide tile) into the K block's stage
  (``ScalesIntoStages``): each lane's copies count as one arrival on the stage's full
  barrier, so the math warps wait once per K block for tiles and scales together (a
  separate scale pipeline cost a second wait per block: 0.5-1% at prefill, session 9),
  and they read scales from shared memory only.  With a visit's first K block it also copies the
  visit's segment record (the expert's two offsets and its count), so the math warps
  read nothing from global memory at all (a lookup between visits idled the tensor cores).
  Both producer warps look up the next visit's expert right after issuing the current
  visit's first K block.
* warp groups 1-2 (math, 64 rows each, ``QGMMA.64x128x32`` x 4 per K block and 128 columns), with
  registers moved from the producer group (40) to them (232).  Two temporary
  accumulators alternate: K block ``j + 1``'s WGMMAs are issued before K block
  ``j``'s are waited for (``wait_group(1)``), so the promotion's FFMAs of one block
  run while the tensor cores work on the next.  The 256-wide tile (accumulator 2 x 64 registers)
  has room for one 64-register temporary only (``wide_k_block``): per K block, each 128-wide half
  of B (one B scale block) is issued into it, waited for and promoted, so a warp group's
  promotion overlaps the other warp group's WGMMAs instead of its own.  After a tile's last K block the
  accumulator goes to bf16 through shared memory (stmatrix, 128 x 32 sub-tiles) and
  out by TMA stores, which clip columns past N; the producer warps meanwhile run
  ahead into the next tile.  For short K loops (K <= 2048, except at decode sizes with counts:
  ``store_behind_epilogue``) the whole tile goes to shared memory at once and its stores drain during the next
  tile's K loop (the 256-wide tile: only where experts average 1.5 real M tiles or more, as it
  costs a stage); otherwise two sub-tile buffers alternate, each reused once read.
  With ``expert_counts``, a warp group whose 64 rows of the tile are all past the
  segment's count waits for and frees every stage without issuing math, and a tile
  with at most ``SPARSE_ROWS`` = 64 real rows (decode; a segment's last tile) skips
  the shared-memory epilogue: the first math warp group stores those rows from its
  registers and the padding rows are not written (at T=1 the w2 GEMM otherwise
  writes 14.7 MB of output for 115 KB of real rows, at T=1024 470 MB for 117 MB).

Rows before ``expert_offsets[0]`` (normally 0) and at or past ``expert_offsets[-1]`` are
unspecified.  Constraints: K % 128 == 0; N % 8 == 0; M_cap % 128 == 0 and every segment length a
multiple of 128 (``align(..., alignment=128)``); a tile of a segment that breaks
this is written as NaN, never as a plausible wrong answer.  A, B K-major with
16-byte aligned rows; a_scale MN-major with a 16-byte aligned base and column stride.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..compiler import cached_compile, compile_kernel, fake_tensor
from .fp8_group import group_amax, quantize_group_fp8, quantize_with_amax
from .host_checks import empty_mn_major
from .silu_mul_quant import silu_mul
from .grouped_gemm_schedule import (
    CLUSTER_M, CLUSTER_N, PAIRS_PER_BAND, ROW_ALIGNMENT, SPARSE_ROWS, TILE_K, TILE_M, TILE_N, WIDE_TILE_N,
    can_implement, check_sm90_variant, cluster_along_m, expert_and_rows, fake_operands, fp8_operands, launch,
    launch_grid, load_scales, pair_launch_grid, pair_schedule, sm90_launch_config, sm90_swiglu_tile, valid_tiles,
    visit_coords, visit_expert,
)  # fmt: skip

# (K-block stages, 128 x 32 bf16 output buffers): 6 x (16 KB A + 16 KB B + 528 B scales and segment) +
# 2 x 8 KB, about 212 KB of shared memory; with the store-behind epilogue 5 stages and the whole tile,
# about 195 KB.  The 128 x 256 tile: 4 x (16 KB + 32 KB + 532 B) + 2 x 8 KB, about 211 KB; with the
# store-behind epilogue's 64 KB, 3 stages (about 210 KB).  Exact sizes: ``dynamic_smem_bytes``.
STAGES, STORE_BEHIND_STAGES, WIDE_STAGES, WIDE_STORE_BEHIND_STAGES = 6, 5, 4, 3
EPI_N = 32
EPI_BUFFERS = 2
# The WGMMA's N, and the columns of one B scale block: the wide tile runs as halves of this width.
WGMMA_N = 128
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232
_TMA_WARP, _SCALE_WARP = 0, 1
_NUM_CONSUMER_WARPS = 8
_EPI_BARRIER = 1  # named barrier of the math warps (0 is __syncthreads)
# With expert counts, the TMA warp loads only the first R rows of a tile's A block, R the first of
# these at or above the tile's real rows (decode tiles hold a few; a segment has at most T rows).
A_BOX_ROWS = (16, SPARSE_ROWS, TILE_M)


@dataclass(frozen=True)
class ScalesIntoStages:
    """The scale warp's side of the K-block pipeline, for ``load_scales``: it waits for a stage to be
    free like the TMA warp, copies the block's scales into that stage, and counts as 32 of the
    stage's full-barrier arrivals (one per lane, when the lane's cp.async copies have landed), so
    that the math warps wait once per K block for tiles and scales together."""

    ab_pipe: pipeline.PipelineTmaAsync

    def producer_acquire(self, state):
        self.ab_pipe.sync_object_empty.wait(state.index, state.phase)

    def producer_commit(self, state):
        cute.arch.cp_async_mbarrier_arrive_noinc(self.ab_pipe.sync_object_full.get_barrier(state.index))

    def producer_tail(self, state):
        """Wait until the math warps have freed every stage (as the TMA warp does), so that none of
        this warp's cp.async copies is still in flight when it exits."""
        self.ab_pipe.producer_tail(state)


class GroupedGemmFp8Sm90:
    """Static configuration: tile shape, pipeline depth, epilogue (e4m3 in; bf16 out, or with
    ``swiglu`` FP8 codes and their f32 scales)."""

    num_threads = 384
    can_implement = staticmethod(can_implement)

    def __init__(self, block_scaled: bool = True, has_counts: bool = False, along_m: bool = False,
                 store_behind: bool = False, tile_n: int = TILE_N, swiglu: bool = False, gate_first: bool = True,
                 ue8m0: bool = False):  # fmt: skip
        # swiglu: the w13 GEMM with silu_mul_quant in its epilogue (``grouped_gemm_fp8_swiglu_cuda``):
        # the tile's first half holds w13's gate rows [h j, h j + h) (h = tile_n / 2; I + h j when not
        # gate_first) and its second half the matching up rows, so that the epilogue has silu(gate) *
        # up for h columns.  256 wide: one 1x128 quantization group per row.  128 wide
        # (``split_group``): half a group, the pair's other tile (pairs along N) the other half.
        self.swiglu, self.gate_first, self.ue8m0 = swiglu, gate_first, ue8m0
        if swiglu and (store_behind or not block_scaled or (tile_n == TILE_N and along_m)):
            raise ValueError("grouped_gemm_fp8 swiglu: block-scaled, without the store-behind epilogue, and the "
                             "128-wide tile with pairs along N only")  # fmt: skip
        self.split_group = swiglu and tile_n == TILE_N
        # block_scaled=False drops the scales (one accumulator, no promotion; same tiles and
        # pipeline): a benchmark-only variant that measures what the promotion costs.
        self.block_scaled = block_scaled
        # has_counts: the launch passes expert_counts (real rows per segment; the rest is padding).
        self.has_counts = has_counts
        # along_m: clusters of 2 on M tiles 2i, 2i + 1 of one N tile, sharing the weight tile when both
        # are one expert's (prefill MoE); else on N tiles 2j, 2j + 1 of one M tile, sharing the A tile.
        self.along_m = along_m
        # store_behind: the epilogue writes the whole bf16 tile to shared memory and leaves its TMA
        # stores to drain during the next tile's K loop (one K-block stage less makes room: 5 or 3); else the
        # math warps wait for each 128 x 32 sub-tile's store before reusing its buffer.
        self.store_behind = store_behind
        # tile_n: 128, or 256 (WIDE_TILE_N) run as two 128-wide halves through one temporary
        # accumulator (``wide_k_block``), whose A and B tiles cost 25% fewer operand bytes per FLOP.
        check_sm90_variant(tile_n)
        self.tile_n = tile_n
        self.n_halves = tile_n // WGMMA_N
        # B scales per K block: one per 128-wide half, or with swiglu the gate block's and the up block's.
        self.b_blocks = 2 if swiglu else self.n_halves
        if store_behind:
            self.stages = STORE_BEHIND_STAGES if tile_n == TILE_N else WIDE_STORE_BEHIND_STAGES
        else:
            self.stages = STAGES if tile_n == TILE_N else WIDE_STAGES
        # A boxes with expert counts and pairs along N, unless store_behind: measured against whole
        # tiles (bench/NOTES.md, session 15) on the w13 GEMM from decode to routed T = 4096, where they
        # paid; with pairs along M and under store_behind (128 wide at K <= 2048, session 15) whole
        # tiles were as quick or quicker.  The 256-wide tile at K <= 2048 keeps them below
        # WIDE_STORE_BEHIND_TILES real M tiles per expert, where it does not store behind, and the
        # 128-wide one below DECODE_TILES (session 28).
        self.a_boxes = A_BOX_ROWS if has_counts and not along_m and not store_behind else (TILE_M,)
        self.epi_buffers = tile_n // EPI_N if store_behind else EPI_BUFFERS
        # SharedStorage's size (asserted where it is declared): each field at its alignment, the whole
        # rounded up to the largest (1024 B, the swizzled tiles').  split_group has no output buffers:
        # two exchange barriers and two slots of 128 row amaxes instead (``pair_swiglu_epilogue``).
        fields = [(8 * 2 * self.stages, 8), (4 * TILE_M * self.stages, 16), (4 * self.b_blocks * self.stages, 16),
                  (4 * 3 * self.stages, 16), (TILE_M * TILE_K * self.stages, 1024), (tile_n * TILE_K * self.stages, 1024)]
        if self.split_group:
            fields += [(8 * 2, 8), (4 * TILE_M * 2, 16)]
        else:
            fields.append((self.epi_buffers * TILE_M * EPI_N * 2, 1024))
        offset = 0
        for size, align in fields:
            offset = -(-offset // align) * align + size
        self.dynamic_smem_bytes = -(-offset // 1024) * 1024

    def a_box_layout(self, sA_layout, rows: int):
        """The first ``rows`` rows of each A stage (``rows`` a multiple of 8: whole swizzle atoms), as
        a box of that height lands in it."""
        head = cute.make_layout((rows, TILE_K, self.stages), stride=(1, TILE_M, TILE_M * TILE_K))
        return cute.make_composed_layout(sA_layout.inner, 0, cute.composition(sA_layout.outer, head))

    def _smem_layout(self, rows: int):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float8E4M3FN, TILE_K),
            cutlass.Float8E4M3FN,
        )
        return cute.tile_to_shape(atom, (rows, TILE_K, self.stages), order=(0, 1, 2))

    def make_tiled_mma(self):
        """Two warp groups of QGMMA.64x128x32 (e4m3 x e4m3 -> f32), one above the other; a 256-wide
        tile issues them on each half of its B tile."""
        fp8 = cutlass.Float8E4M3FN
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(fp8, fp8, k_major, k_major, Float32, (2, 1, 1), tiler_mn=(64, WGMMA_N))

    @cute.jit
    def __call__(self, mA, mB, mSA, mSB, mOff, mC, mCnt, mQS, grid_ctas: Int32, stream):
        """``mC``: the bf16 output, or with ``swiglu`` the FP8 codes (uint8 [M_cap, I]) and ``mQS``
        their scales (f32 [M_cap, I/128], MN-major); otherwise ``mQS`` is unused."""
        fp8 = cutlass.Float8E4M3FN
        mA, mB = fp8_operands(mA, mB)  # (M_cap, K), (N, K, E)
        tiled_mma = self.make_tiled_mma()
        sA_layout = self._smem_layout(TILE_M)
        sB_layout = self._smem_layout(self.tile_n)
        # swiglu: B by half-tile boxes (gate rows and up rows per stage), else by whole tiles.
        b_rows = self.tile_n // 2 if self.swiglu else self.tile_n
        sB_tile = cute.slice_(self._smem_layout(b_rows), (None, None, 0))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB, sB_tile, (b_rows, TILE_K))
        # A's TMA atoms, one per box height (A_BOX_ROWS with counts): pairs along N multicast (each CTA
        # loads half the box's rows), pairs along M load per CTA.
        a_op = cpasync.CopyBulkTensorTileG2SOp() if self.along_m else cpasync.CopyBulkTensorTileG2SMulticastOp()
        a_kw = {} if self.along_m else {"num_multicast": CLUSTER_N}
        tma_a, tma_mA = [], []
        for rows in self.a_boxes:
            atom, tensor = cpasync.make_tiled_tma_atom(
                a_op, mA, cute.slice_(self.a_box_layout(sA_layout, rows), (None, None, 0)), (rows, TILE_K), **a_kw
            )
            tma_a.append(atom)
            tma_mA.append(tensor)
        tma_a, tma_mA = tuple(tma_a), tuple(tma_mA)
        if cutlass.const_expr(self.along_m):
            # B two ways: a pair of M tiles of one expert loads the tile once (half per CTA, each half
            # multicast to both CTAs); a pair across two experts loads it per CTA.
            tma_b_pair, tma_mB_pair = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp(), mB, sB_tile, (b_rows, TILE_K), num_multicast=CLUSTER_M
            )
            tma_b, tma_mB = (tma_b, tma_b_pair), (tma_mB, tma_mB_pair)
        c_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, EPI_N), cutlass.BFloat16
        )
        sC_layout = cute.tile_to_shape(c_atom, (TILE_M, EPI_N, self.epi_buffers), order=(0, 1, 2))
        # The TMA store clips what lies past N (e.g. N = 2112) or M_cap (the past-end tile of an odd pair
        # along M), and writes nothing for a multicast-only visit past the last N tile (pairs along N).
        if cutlass.const_expr(self.split_group):
            # Codes stored from registers (pair_swiglu_epilogue): no TMA store.
            mC = cute.make_tensor(cute.recast_ptr(mC.iterator, dtype=fp8), mC.layout)
            tma_c, tma_mC = None, mC
        elif cutlass.const_expr(self.swiglu):
            # The codes of one 128 x 128 tile, row-major in the epilogue's buffers (16 KB), one TMA store.
            mC = cute.make_tensor(cute.recast_ptr(mC.iterator, dtype=fp8), mC.layout)
            tma_c, tma_mC = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mC, self.q_layout(), (TILE_M, WGMMA_N)
            )
        else:
            tma_c, tma_mC = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)), (TILE_M, EPI_N)
            )

        self.shared_storage = self.make_shared_storage(sA_layout, sB_layout, sC_layout)
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, sA_layout, sB_layout, sC_layout, mSA, mSB,
                    mOff, mCnt, mC, mQS).launch(  # fmt: skip
            grid=[grid_ctas, 1, 1],
            block=[self.num_threads, 1, 1],
            cluster=[CLUSTER_M if self.along_m else CLUSTER_N, 1, 1],  # the pair's CTAs: consecutive block indices
            min_blocks_per_mp=1,
            stream=stream,
        )

    def make_shared_storage(self, sA_layout, sB_layout, sC_layout):
        """The kernel's shared memory: per stage its barriers, scales, segment record, A and B tiles;
        then the output buffers, or with ``split_group`` the amax exchange's two barriers and slots."""
        fp8 = cutlass.Float8E4M3FN
        align, mem = cute.struct.Align, cute.struct.MemRange
        fields = {
            "ab_barriers": mem[cutlass.Int64, self.stages * 2],
            "sSA": align[mem[Float32, self.stages * TILE_M], 16],
            "sSB": align[mem[Float32, self.b_blocks * self.stages], 16],
            "sSeg": align[mem[Int32, 3 * self.stages], 16],
            "sA": align[mem[fp8, cute.cosize(sA_layout)], 1024],
            "sB": align[mem[fp8, cute.cosize(sB_layout)], 1024],
        }
        if self.split_group:
            fields["x_barriers"] = mem[cutlass.Int64, 2]
            fields["sX"] = align[mem[Float32, 2 * TILE_M], 16]
        else:
            fields["sC"] = align[mem[cutlass.BFloat16, cute.cosize(sC_layout)], 1024]
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        assert SharedStorage.size_in_bytes() == self.dynamic_smem_bytes, (
            SharedStorage.size_in_bytes(), self.dynamic_smem_bytes)  # fmt: skip
        return SharedStorage

    def q_layout(self):
        """swiglu: a tile's FP8 codes in shared memory, 128 B per row, 128-byte swizzled (the 16-byte
        chunk index XOR the row mod 8), as the TMA store reads it.  The epilogue writes it by hand
        (``swiglu_epilogue``): through this layout's generic indexing the kernel spilled 144 B, and
        unswizzled, a warp's 8 rows store each column to one bank (8-way conflicts)."""
        fp8 = cutlass.Float8E4M3FN
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, fp8, WGMMA_N), fp8)
        return cute.tile_to_shape(atom, (TILE_M, WGMMA_N), order=(0, 1))

    @cute.kernel
    def kernel(self, tiled_mma, tma_a, mA, tma_b, mB, tma_c, mC, sA_layout, sB_layout, sC_layout, mSA, mSB, mOff,
               mCnt, mC_direct, mQS):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        num_experts = mOff.shape[0] - 1
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        n = mC.shape[1] * (2 if self.swiglu else 1)  # B's rows (2I with swiglu, whose output has I columns)
        if cutlass.const_expr(self.along_m):
            cluster_mn = (CLUSTER_M, 1)
            # M tiles 2i, 2i + 1 of one N tile (grouped_gemm_schedule.pair_tile_schedule); B shared.
            sched = pair_schedule(mOff, num_experts, mC.shape[0], n, mA[0].shape[1], PAIRS_PER_BAND,
                                  bidx // CLUSTER_M, grid // CLUSTER_M, rank, self.tile_n)  # fmt: skip
        else:
            cluster_mn = (1, CLUSTER_N)
            # N tiles 2j, 2j + 1 of one M tile (grouped_gemm_schedule.tile_schedule); A shared.
            n_groups = (n + self.tile_n * CLUSTER_N - 1) // (self.tile_n * CLUSTER_N)
            sched = (bidx // CLUSTER_N, valid_tiles(mOff, num_experts, mC.shape[0], n_groups), grid // CLUSTER_N,
                     n_groups, mA[0].shape[1] // TILE_K, rank)  # fmt: skip
        cta_layout = cute.make_layout((*cluster_mn, 1))
        shared_mode = 0 if self.along_m else 1  # the cluster mode along which a multicast tile is shared
        mcast_mask = cute.make_layout_image_mask(cta_layout, cta_layout.get_flat_coord(rank), mode=shared_mode)
        if warp_idx == _TMA_WARP:
            for atom in tma_a:
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.along_m):
                cpasync.prefetch_descriptor(tma_b[0])
                cpasync.prefetch_descriptor(tma_b[1])
            else:
                cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(not self.split_group):
                cpasync.prefetch_descriptor(tma_c)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        # A stage's full-barrier byte count with a whole A tile (with A boxes, load_ab sets each stage's).
        tx_bytes = cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sA_layout, (None, None, 0))) + cute.size_in_bytes(
            cutlass.Float8E4M3FN, cute.slice_(sB_layout, (None, None, 0))
        )
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.stages,
            # A stage is full when the TMA thread's arrival (with the tiles' byte count) and one arrival
            # per scale-warp lane (when that lane's cp.async copies have landed) are in.
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + 32),
            # Every consumer warp of both CTAs frees a stage: the partner may multicast into it.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * _NUM_CONSUMER_WARPS),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout.shape)),
            defer_sync=True,
        )
        if cutlass.const_expr(self.split_group):
            # The amax exchange's barriers (pair_swiglu_epilogue), one per visit parity: each phase
            # completes with the one local arrival that expects the partner's 128 stores.
            if tidx == 0:
                for slot in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(storage.x_barriers.data_ptr() + slot, 1)
                cute.arch.mbarrier_init_fence()
        # Both CTAs' barriers are initialised before either multicasts (or stores) into the other.
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sSA = storage.sSA.get_tensor(cute.make_layout((TILE_M, self.stages)))
        sSB = storage.sSB.get_tensor(cute.make_layout((self.b_blocks, self.stages)))
        sSeg = storage.sSeg.get_tensor(cute.make_layout((3, self.stages)))
        if cutlass.const_expr(self.split_group):
            sC = (storage.sX.get_tensor(cute.make_layout((TILE_M, 2))), storage.x_barriers.data_ptr())
        else:
            sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        if cutlass.const_expr(self.swiglu and not self.split_group):
            q_layout = self.q_layout()
            sC = (cute.make_tensor(cute.recast_ptr(storage.sC.data_ptr(), q_layout.inner, dtype=cutlass.Float8E4M3FN),
                                   q_layout.outer),  # the TMA store's source
                  cute.make_tensor(cute.recast_ptr(storage.sC.data_ptr(), dtype=cutlass.Uint16),
                                   cute.make_layout(TILE_M * WGMMA_N // 2)))  # the same bytes, as pairs  # fmt: skip

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)

        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        if warp_group == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == _TMA_WARP:
                boxes = [self.a_box_layout(sA_layout, rows) for rows in self.a_boxes]
                sA_boxes = tuple(storage.sA.get_tensor(box.outer, swizzle=box.inner) for box in boxes)
                self.load_ab(tma_a, mA, tma_b, mB, sA_boxes, sB, ab_pipe, (mOff, mCnt), num_experts, lane, mcast_mask,
                             sched)  # fmt: skip
            if warp_idx == _SCALE_WARP:
                load_scales(mSA, mSB, sSA, sSB, ScalesIntoStages(ab_pipe), self.stages, mOff, num_experts, lane,
                            sched, segment=(mCnt, sSeg), pairs=self.along_m, b_blocks=self.b_blocks,
                            swiglu_gate=(0 if self.gate_first else 1) if self.swiglu else None,
                            tiles_per_block=2 if self.split_group else 1)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self.math(tiled_mma, sA, sB, sSA, sSB, sSeg, sC, ab_pipe, tma_c, (mC, mC_direct, mQS), tidx - 128, sched)

    @cute.jit
    def load_ab(self, tma_a, mA, tma_b, mB, sA_boxes, sB, ab_pipe, segments, num_experts, lane, mcast_mask, sched):
        """TMA warp: per K block, the A tile and expert e's B tile into one stage.  Pairs along N:
        this CTA's half of A, multicast to both CTAs.  Pairs along M: the B tile once per pair (this
        CTA's half, multicast to both) when both M tiles are e's, else whole.  With expert counts,
        only A's first ``A_BOX_ROWS`` rows that hold the tile's real rows (``sA_boxes``, ``tma_a``:
        one per box height); the math reads whatever the rest of the stage holds into accumulator
        rows that are never stored, and sets each stage's expected bytes to match."""
        mOff, mCnt = segments
        first_tile, tiles, tile_stride, k_tiles, rank = sched[0], sched[1], sched[2], sched[4], sched[5]
        # B's destinations: the whole stage, or with swiglu its two halves (gate rows, up rows).
        b_rows = self.tile_n // 2 if self.swiglu else self.tile_n
        sB_parts = [sB] if not self.swiglu else [cute.local_tile(sB, (b_rows, TILE_K, self.stages), (h, 0, 0))
                                                 for h in range(2)]  # fmt: skip
        if cutlass.const_expr(self.along_m):
            (tma_b, tma_b_pair), (mB, mB_pair) = tma_b, mB
            gB_pair = cute.local_tile(mB_pair, (b_rows, TILE_K), (None, None, None))  # (bN, bK, RestN, RestK, E)
            tBsB_pair, tBgB_pair = [], None
            for part in sB_parts:
                part_s, tBgB_pair = cpasync.tma_partition(tma_b_pair, rank, cute.make_layout(CLUSTER_M),
                                                          cute.group_modes(part, 0, 2),
                                                          cute.group_modes(gB_pair, 0, 2))  # fmt: skip
                tBsB_pair.append(part_s)
        # Per box height: this CTA's part of the box (all of it along M, half along N) and its source.
        a_parts = []
        a_cta, a_ctas = (0, 1) if self.along_m else (rank, CLUSTER_N)
        a_mcast = {} if self.along_m else {"mcast_mask": mcast_mask}
        for i, rows in enumerate(self.a_boxes):
            gA = cute.local_tile(mA[i], (rows, TILE_K), (None, None))  # (rows, bK, RestM, RestK)
            a_parts.append(cpasync.tma_partition(tma_a[i], a_cta, cute.make_layout(a_ctas),
                                                 cute.group_modes(sA_boxes[i], 0, 2),
                                                 cute.group_modes(gA, 0, 2)))  # fmt: skip
        gB = cute.local_tile(mB, (b_rows, TILE_K), (None, None, None))  # (bN, bK, RestN, RestK, E)
        tBsB, tBgB = [], None
        for part in sB_parts:
            part_s, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(part, 0, 2),
                                                 cute.group_modes(gB, 0, 2))  # fmt: skip
            tBsB.append(part_s)
        # swiglu: the B row block of half h (gate, up) of N tile j: j, or j + I / b_rows, swapped when
        # not gate_first.
        half_blocks = mB.shape[0] // (2 * b_rows)
        b_offsets = [0] if not self.swiglu else [((h ^ (0 if self.gate_first else 1)) * half_blocks) for h in range(2)]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        expert, shared, rows = self.visit_expert_rows(mOff, mCnt, num_experts, lane, first_tile, sched)
        for tile in cutlass.range(first_tile, tiles, tile_stride, unroll=1):
            m_tile, n_tile = visit_coords(tile, sched, self.along_m)
            next_expert, next_shared, next_rows = expert, shared, rows
            box, stage_bytes = self.a_box_of(rows)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                if cutlass.const_expr(len(self.a_boxes) > 1):
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                    ab_pipe.sync_object_full.arrive_and_expect_tx(state.index, stage_bytes)
                else:
                    ab_pipe.producer_acquire(state)
                barrier = ab_pipe.producer_get_barrier(state)
                for i in cutlass.range_constexpr(len(self.a_boxes)):
                    tAsA, tAgA = a_parts[i]
                    src, dst = tAgA[(None, m_tile * (TILE_M // self.a_boxes[i]), k_tile)], tAsA[(None, state.index)]
                    if cutlass.const_expr(len(self.a_boxes) > 1):
                        if box == i:
                            cute.copy(tma_a[i], src, dst, tma_bar_ptr=barrier, **a_mcast)
                    else:
                        cute.copy(tma_a[i], src, dst, tma_bar_ptr=barrier, **a_mcast)
                for h in cutlass.range_constexpr(len(sB_parts)):
                    block = n_tile + b_offsets[h]
                    if cutlass.const_expr(self.along_m):
                        if shared:
                            cute.copy(tma_b_pair, tBgB_pair[(None, block, k_tile, expert)],
                                      tBsB_pair[h][(None, state.index)], tma_bar_ptr=barrier,
                                      mcast_mask=mcast_mask)  # fmt: skip
                        else:
                            cute.copy(tma_b, tBgB[(None, block, k_tile, expert)], tBsB[h][(None, state.index)],
                                      tma_bar_ptr=barrier)  # fmt: skip
                    else:
                        cute.copy(tma_b, tBgB[(None, block, k_tile, expert)], tBsB[h][(None, state.index)],
                                  tma_bar_ptr=barrier)  # fmt: skip
                ab_pipe.producer_commit(state)
                state.advance()
                if k_tile == 0:
                    # The next visit's expert and real rows, looked up while this visit's first stage
                    # is in flight.
                    next_expert, next_shared, next_rows = self.visit_expert_rows(mOff, mCnt, num_experts, lane,
                                                                                 tile + tile_stride, sched)  # fmt: skip
            expert, shared, rows = next_expert, next_shared, next_rows
        ab_pipe.producer_tail(state)

    @cute.jit
    def a_box_of(self, rows):
        """(index into A_BOX_ROWS of the first box at or above ``rows``, the stage's expected bytes
        with it), warp-uniform; (0, unused) with one box."""
        box = Int32(0)
        stage_bytes = Int32((self.a_boxes[0] + self.tile_n) * TILE_K)
        for i in cutlass.range_constexpr(1, len(self.a_boxes)):
            taller = Int32(rows > self.a_boxes[i - 1])
            box += taller
            stage_bytes += taller * ((self.a_boxes[i] - self.a_boxes[i - 1]) * TILE_K)
        return cute.arch.make_warp_uniform(box), cute.arch.make_warp_uniform(stage_bytes)

    @cute.jit
    def visit_expert_rows(self, mOff, mCnt, num_experts, lane, tile, sched):
        """(expert, shared, real rows) of visit ``tile``: ``visit_expert``, and with A boxes the
        tile's real rows (``expert_and_rows``, same round trip; may be <= 0 or > TILE_M); otherwise
        every tile is taken as full."""
        if cutlass.const_expr(len(self.a_boxes) > 1):
            m_tile, _ = visit_coords(tile, sched, self.along_m)
            expert, rows = expert_and_rows(mOff, mCnt, m_tile * TILE_M, num_experts, lane)
            return expert, Int32(0) != 0, rows
        expert, shared = visit_expert(mOff, num_experts, lane, tile, sched, self.along_m)
        return expert, shared, Int32(TILE_M)

    @cute.jit
    def math(self, tiled_mma, sA, sB, sSA, sSB, sSeg, sC, ab_pipe, tma_c, mC, math_tidx, sched):
        """Math warp groups: per tile, the K loop, then the epilogue.  ``mC``: the output as the TMA
        store's coordinate tensor and as a plain global tensor (``sparse_epilogue``'s stores)."""
        mC, mC_direct, mQS = mC
        first_tile, tiles, tile_stride, k_tiles = sched[0], sched[1], sched[2], sched[4]
        thr_mma = tiled_mma.get_slice(math_tidx)
        # A warp group's operand descriptors depend on its index only: taken from a warp-uniform
        # slice they stay on the uniform datapath (no R2UR per WGMMA).
        thr_mma_wg = tiled_mma.get_slice(cute.arch.make_warp_uniform(math_tidx // 128) * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
        # Per WGMMA_N-wide half of the tile: B's fragment, and the accumulator (one tensor per half;
        # tCcC: an element's coordinates within its half).
        tCrB = [tiled_mma.make_fragment_B(thr_mma_wg.partition_B(
            cute.local_tile(sB, (WGMMA_N, TILE_K, self.stages), (h, 0, 0)))) for h in range(self.n_halves)]  # fmt: skip
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, WGMMA_N)))
        acc = [cute.make_rmem_tensor(tCcC.shape, Float32) for _ in range(self.n_halves)]
        tmp0 = cute.make_rmem_tensor(tCcC.shape, Float32)
        tmp1 = cute.make_rmem_tensor(tCcC.shape, Float32)
        # Pipeline positions (stage index, phase) of the next K block to issue (r) and to finish
        # (d), carried across tiles as plain integers.
        r_idx, r_ph, d_idx, d_ph = Int32(0), Int32(0), Int32(0), Int32(0)
        # The accumulator fragment covers two rows per thread: element i's row is row0 + ROW_OFF[i].
        c0 = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, WGMMA_N)))
        row_offsets = sorted({c0[i][0] - c0[0][0] for i in range(cute.size(c0))})
        # sparse_epilogue stores elements 2j, 2j + 1 together (adjacent columns of one row), from the
        # first warp group only (its last thread must hold row SPARSE_ROWS - 1 or later).
        assert all(c0[i + 1][0] == c0[i][0] and c0[i + 1][1] == c0[i][1] + 1 for i in range(0, cute.size(c0), 2))
        c127 = tiled_mma.get_slice(127).partition_C(cute.make_identity_tensor((TILE_M, WGMMA_N)))
        assert max(c127[i][0] for i in range(cute.size(c127))) >= SPARSE_ROWS - 1
        which_row = [row_offsets.index(c0[i][0] - c0[0][0]) for i in range(cute.size(c0))]
        col_of = [c0[i][1] for i in range(cute.size(c0))]  # thread 0's; a thread adds its first column (< 8)
        rows = (tCcC[0][0], row_offsets, which_row)
        # The scales of tmp0's / tmp1's K block, one per row of the thread (the wide tile: the block's
        # A scales, and their products with a half's B scale); with split_group per row and column
        # half (gate columns take the gate block's B scale, up columns the up block's): which_scale.
        col_blocks = 2 if self.split_group else 1
        which_scale = [which_row[i] + len(row_offsets) * int(col_of[i] >= TILE_N // 2) * (col_blocks - 1)
                       for i in range(cute.size(c0))]  # fmt: skip
        scl0 = cute.make_rmem_tensor((len(row_offsets) * col_blocks,), Float32)
        scl1 = cute.make_rmem_tensor((len(row_offsets) * col_blocks,), Float32)
        epi = None if self.swiglu else self.make_epilogue(tiled_mma, sC, acc, math_tidx)
        gate_up = self.gate_up_elements(which_row, col_of) if self.split_group else None
        for tile in cutlass.range(first_tile, tiles, tile_stride, unroll=1):
            m_tile, n_tile = visit_coords(tile, sched, self.along_m)
            # The visit's segment record (start, end, count) came with its first stage's scales.
            ab_pipe.consumer_wait(self._state(r_idx, r_ph))
            seg_start, seg_end = sSeg[0, r_idx], sSeg[1, r_idx]
            # A tile of a segment that breaks the 128-row alignment comes out NaN (never a plausible
            # wrong answer): its accumulator starts as NaN, which every promotion keeps.
            acc_init = Float32(0.0)
            if (seg_start % TILE_M) | (seg_end % TILE_M) != 0:
                acc_init = Float32(float("nan"))
            for h in cutlass.range_constexpr(self.n_halves):
                acc[h].fill(acc_init)
            # With expert counts, a warp group whose 64 rows are all padding only keeps the
            # pipelines in step (decode: one real row per expert halves the tensor-core work).
            busy = True
            sparse = False
            if cutlass.const_expr(self.has_counts):
                rows_left = sSeg[2, r_idx] - (m_tile * TILE_M - seg_start)
                # Warp-uniform as the compiler sees it: a branch it must treat as divergent keeps
                # the K loop off the uniform datapath (WGMMA descriptors built in vector registers
                # and moved by R2UR, convergence barriers around each block).
                busy = cute.arch.make_warp_uniform(Int32(rows_left > (math_tidx // 128) * (TILE_M // 2))) != 0
                # Only for an aligned segment whose real rows lie inside the tile (a misaligned
                # one's tile is written whole, as NaN).
                sparse = cute.arch.make_warp_uniform(Int32(
                    rows_left <= SPARSE_ROWS and acc_init == Float32(0.0) and m_tile * TILE_M + rows_left <= seg_end
                )) != 0  # fmt: skip
            if cutlass.const_expr(not self.block_scaled):
                r_idx, r_ph, d_idx, d_ph = self.unscaled_k_loop(acc, tCrA, tCrB, ab_pipe, k_tiles, r_idx, r_ph, d_idx,
                                                                d_ph)  # fmt: skip
            elif busy:
                if cutlass.const_expr(self.n_halves == 1):
                    r_idx, r_ph, d_idx, d_ph = self.scaled_k_loop(
                        acc[0], (tmp0, scl0, which_scale), (tmp1, scl1, which_scale), tCrA, tCrB[0], rows, sSA, sSB,
                        ab_pipe, k_tiles, r_idx, r_ph, d_idx, d_ph,
                    )  # fmt: skip
                else:
                    for _k in cutlass.range(k_tiles, unroll=1):
                        self.wide_k_block(acc, tmp0, (scl0, scl1, which_row), tCrA, tCrB, rows, sSA, sSB, ab_pipe,
                                          r_idx, r_ph)  # fmt: skip
                        r_idx, r_ph = self._next(r_idx, r_ph)
                    d_idx, d_ph = r_idx, r_ph
            else:
                r_idx, r_ph = self.idle_k_loop(ab_pipe, k_tiles, r_idx, r_ph)
                d_idx, d_ph = r_idx, r_ph
            if cutlass.const_expr(self.split_group):
                # With counts the real rows only, as sparse_epilogue: a misaligned segment's tile is
                # written whole (as NaN), as are rows of a count past the segment's end.
                live_rows = Int32(TILE_M)
                if cutlass.const_expr(self.has_counts):
                    if acc_init == Float32(0.0) and m_tile * TILE_M + rows_left <= seg_end:
                        live_rows = rows_left
                self.pair_swiglu_epilogue(acc[0], tCcC, gate_up, sC, mC_direct, mQS, m_tile, n_tile, live_rows,
                                          (tile - first_tile) // tile_stride, math_tidx)  # fmt: skip
            elif cutlass.const_expr(self.swiglu):
                self.swiglu_epilogue(acc, tCcC, (which_row, [c0[i][1] for i in range(cute.size(c0))]), sC, tma_c, mC,
                                     mQS, m_tile, n_tile, math_tidx)  # fmt: skip
            elif cutlass.const_expr(self.has_counts):
                if sparse:
                    self.sparse_epilogue(acc, tCcC, mC_direct, m_tile, n_tile, rows_left, math_tidx)
                else:
                    self.epilogue(epi, tma_c, mC, m_tile, n_tile, math_tidx)
            else:
                self.epilogue(epi, tma_c, mC, m_tile, n_tile, math_tidx)
        if math_tidx // 32 == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the last stores' reads

    @cute.jit
    def scaled_k_loop(self, acc, buf0, buf1, tCrA, tCrB, rows, sSA, sSB, ab_pipe, k_tiles, r_idx, r_ph,
                      d_idx, d_ph):  # fmt: skip
        """Block 0 into buffer 0, then pairs (next -> buffer 1 while buffer 0 is promoted, next ->
        buffer 0 while buffer 1 is), then the tail by the parity of the K block count.  A buffer is
        a temporary accumulator and its block's scales.  Returns the new pipeline positions."""
        scales = (rows, sSA, sSB)
        self.issue_scaled(buf0, tCrA, tCrB, ab_pipe, scales, r_idx, r_ph)
        r_idx, r_ph = self._next(r_idx, r_ph)
        for _pair in cutlass.range((k_tiles - 1) // 2, unroll=1):
            self.issue_scaled(buf1, tCrA, tCrB, ab_pipe, scales, r_idx, r_ph)
            r_idx, r_ph = self._next(r_idx, r_ph)
            warpgroup.wait_group(1)
            self.promote(acc, buf0, ab_pipe, d_idx, d_ph)
            d_idx, d_ph = self._next(d_idx, d_ph)
            self.issue_scaled(buf0, tCrA, tCrB, ab_pipe, scales, r_idx, r_ph)
            r_idx, r_ph = self._next(r_idx, r_ph)
            warpgroup.wait_group(1)
            self.promote(acc, buf1, ab_pipe, d_idx, d_ph)
            d_idx, d_ph = self._next(d_idx, d_ph)
        if k_tiles % 2 == 0:
            self.issue_scaled(buf1, tCrA, tCrB, ab_pipe, scales, r_idx, r_ph)
            r_idx, r_ph = self._next(r_idx, r_ph)
            warpgroup.wait_group(1)
            self.promote(acc, buf0, ab_pipe, d_idx, d_ph)
            d_idx, d_ph = self._next(d_idx, d_ph)
            warpgroup.wait_group(0)
            self.promote(acc, buf1, ab_pipe, d_idx, d_ph)
            d_idx, d_ph = self._next(d_idx, d_ph)
        else:
            warpgroup.wait_group(0)
            self.promote(acc, buf0, ab_pipe, d_idx, d_ph)
            d_idx, d_ph = self._next(d_idx, d_ph)
        return r_idx, r_ph, d_idx, d_ph

    @cute.jit
    def wide_k_block(self, acc, tmp, scl, tCrA, tCrB, rows, sSA, sSB, ab_pipe, idx, ph):
        """One K block of a 256-wide tile: per 128-wide half (one B scale block), its WGMMAs into the
        one temporary, waited for, then promoted into the half's accumulator; the stage is freed
        once the second half's WGMMAs are done.  A warp group's promotion overlaps the other warp
        group's WGMMAs, not its own: a second temporary would not fit (128 + 2 x 64 registers)."""
        scl_a, scl_ab, which_row = scl
        row0, row_offsets, _ = rows
        for h in cutlass.range_constexpr(self.n_halves):
            self.issue(tmp, tCrA, tCrB[h], ab_pipe, idx, ph)
            b_scale = sSB[h, idx]
            for j in cutlass.range_constexpr(len(row_offsets)):
                if cutlass.const_expr(h == 0):
                    scl_a[j] = sSA[row0 + row_offsets[j], idx]
                scl_ab[j] = scl_a[j] * b_scale
            warpgroup.wait_group(0)
            if cutlass.const_expr(h == self.n_halves - 1):
                ab_pipe.consumer_release(self._state(idx, ph))
            for i in cutlass.range_constexpr(cute.size(tmp)):
                acc[h][i] = acc[h][i] + tmp[i] * scl_ab[which_row[i]]

    @cute.jit
    def unscaled_k_loop(self, acc, tCrA, tCrB, ab_pipe, k_tiles, r_idx, r_ph, d_idx, d_ph):
        """The benchmark variant: every K block into ``acc`` (per half), one K block's groups in
        flight, scales unused."""
        for k in cutlass.range(k_tiles, unroll=1):
            for h in cutlass.range_constexpr(self.n_halves):
                self.issue(acc[h], tCrA, tCrB[h], ab_pipe, r_idx, r_ph, accumulate=True)
            r_idx, r_ph = self._next(r_idx, r_ph)
            if k > 0:
                warpgroup.wait_group(self.n_halves)
                ab_pipe.consumer_release(self._state(d_idx, d_ph))
                d_idx, d_ph = self._next(d_idx, d_ph)
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(self._state(d_idx, d_ph))
        d_idx, d_ph = self._next(d_idx, d_ph)
        return r_idx, r_ph, d_idx, d_ph

    @cute.jit
    def idle_k_loop(self, ab_pipe, k_tiles, idx, ph):
        """A warp group with no real rows in the tile: wait for and free every stage (its arrivals
        are part of each stage's count) without touching the data.  Returns the new position."""
        for _k in cutlass.range(k_tiles, unroll=1):
            state = self._state(idx, ph)
            ab_pipe.consumer_wait(state)
            ab_pipe.consumer_release(state)
            idx, ph = self._next(idx, ph)
        return idx, ph

    @cute.jit
    def _next(self, idx, ph):
        """The pipeline position after (idx, ph): no division in the K loop."""
        nxt = idx + 1
        wrap = Int32(nxt == self.stages)
        return nxt - wrap * self.stages, ph ^ wrap

    def _state(self, idx, ph):
        return pipeline.PipelineState(self.stages, idx, idx, ph)

    @cute.jit
    def issue(self, tmp, tCrA, tCrB, ab_pipe, idx, ph, accumulate: cutlass.Constexpr = False):
        """Wait for the K block at pipeline position (idx, ph) and issue its 4 WGMMAs into ``tmp``
        (fresh unless ``accumulate``); not waited for."""
        # A local MMA object: its ACCUMULATE field is staged state that must not leak out of
        # the branch this is called from.
        tiled_mma = self.make_tiled_mma()
        state = self._state(idx, ph)
        ab_pipe.consumer_wait(state)
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            coord = (None, None, kb, state.index)
            cute.gemm(tiled_mma, tmp, tCrA[coord], tCrB[coord], tmp)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def issue_scaled(self, buf, tCrA, tCrB, ab_pipe, scales, idx, ph):
        """``issue`` into the buffer's accumulator, then, while the WGMMAs run, the block's scale of
        each of the thread's rows into registers (they came with the stage)."""
        tmp, scl, _ = buf
        (row0, row_offsets, _), sSA, sSB = scales
        self.issue(tmp, tCrA, tCrB, ab_pipe, idx, ph)
        rows = len(row_offsets)
        for s in cutlass.range_constexpr(cute.size(scl) // rows):  # split_group: the gate block's, the up block's
            b_scale = sSB[s, idx]
            for j in cutlass.range_constexpr(rows):
                scl[s * rows + j] = sSA[row0 + row_offsets[j], idx] * b_scale

    @cute.jit
    def promote(self, acc, buf, ab_pipe, idx, ph):
        """acc += tmp * scale for the K block at (idx, ph) (its WGMMAs already waited for); frees its
        A/B stage."""
        tmp, scl, which_row = buf
        ab_pipe.consumer_release(self._state(idx, ph))
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + tmp[i] * scl[which_row[i]]

    def make_epilogue(self, tiled_mma, sC, acc, math_tidx):
        """The register -> shared memory (stmatrix) partitions."""
        copy_r2s = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=cutlass.BFloat16, elem_ty_acc=Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), tiled_mma
            ),
        )
        thr_r2s = copy_r2s.get_slice(math_tidx)
        tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, buffers)
        tRS_rAcc = [copy_r2s.retile(a) for a in acc]
        sub_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        return copy_r2s, tRS_sC, tRS_rAcc, sub_shape, sC

    @cute.jit
    def sparse_epilogue(self, acc, tCcC, mC, m_tile, n_tile, rows_left, math_tidx):
        """A tile with ``rows_left <= SPARSE_ROWS`` real rows: the first math warp group, which holds
        rows 0-63, stores them from its accumulator, two bf16 per store; padding rows (unspecified
        with expert counts) are not written, nor is anything past M_cap or N."""
        if math_tidx // 128 == 0:
            row0 = m_tile * TILE_M
            rPair = cute.make_rmem_tensor((2,), Float32)
            rOut = cute.make_rmem_tensor((2,), cutlass.BFloat16)
            for h in cutlass.range_constexpr(self.n_halves):
                col0 = n_tile * self.tile_n + h * WGMMA_N
                for i in cutlass.range_constexpr(0, cute.size(acc[h]), 2):
                    r, c = tCcC[i]
                    row, col = row0 + r, col0 + c
                    if r < rows_left and row < mC.shape[0] and col < mC.shape[1]:
                        rPair[0] = acc[h][i]
                        rPair[1] = acc[h][i + 1]
                        rOut.store(rPair.load().to(cutlass.BFloat16))
                        cute.autovec_copy(rOut, cute.local_tile(mC[row, None], (2,), (col // 2,)))

    def gate_up_elements(self, which_row, col_of):
        """split_group: per row of the thread's accumulator fragment, (gate element, up element) pairs
        in fragment order: a gate column c < 64 and its up column c + 64 are one thread's (a thread's
        columns repeat every 8), and consecutive gate elements 2p, 2p + 1 are adjacent columns."""
        half = TILE_N // 2
        pairs = []
        for j in range(max(which_row) + 1):
            gates = [i for i in range(len(col_of)) if which_row[i] == j and col_of[i] < half]
            ups = {col_of[i]: i for i in range(len(col_of)) if which_row[i] == j and col_of[i] >= half}
            pairs.append([(i, ups[col_of[i] + half]) for i in gates])
            assert all(col_of[pairs[-1][2 * p + 1][0]] == col_of[pairs[-1][2 * p][0]] + 1
                       for p in range(len(gates) // 2))  # fmt: skip
        return pairs

    @cute.jit
    def pair_swiglu_epilogue(self, acc, tCcC, gate_up, exchange, mQ, mQS, m_tile, n_tile, live_rows, visit,
                             math_tidx):  # fmt: skip
        """split_group: ``y = silu(gate) * up`` for this tile's 64 output columns, from the
        accumulator rounded to bf16 (``gate_up``: which elements pair up), and the other 64 columns of
        each row's 1x128 group are the pair's other CTA's (N tiles 2j, 2j + 1).  Each row's amax over
        this CTA's half (``group_amax`` over a quad of lanes) goes to the partner by ``st.async`` into
        its slot ``visit % 2`` (``exchange``: the 128 x 2 slots and their barriers), counted as bytes
        on the partner's barrier of that slot, which its own one arrival (expecting 512 bytes) opens;
        after the wait both CTAs quantize with the group's amax, so the codes and scale are
        ``silu_mul_quant``'s, bit for bit.  A slot is written again two visits later, only after
        the partner has waited for this CTA's stores of the visit between, which this warp issues
        after its reads (``sync_warp``).  Codes of rows below ``live_rows`` (every row without counts)
        are stored from registers, two per store; the scale by the pair's rank 0."""
        sX, x_barriers = exchange
        slot = visit % 2
        barrier = x_barriers + slot
        partner = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) ^ 1
        if math_tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, TILE_M * 4)
        per_row = len(gate_up[0])
        rY = [cute.make_rmem_tensor((per_row,), Float32) for _ in gate_up]
        amax = []
        for j in cutlass.range_constexpr(len(gate_up)):
            # h rounded to bf16 as the plain GEMM stores it, then silu_mul_quant's own silu_mul.
            rG, rU = (cute.make_rmem_tensor((per_row,), Float32) for _ in range(2))
            for t in cutlass.range_constexpr(per_row):
                rG[t], rU[t] = acc[gate_up[j][t][0]], acc[gate_up[j][t][1]]
            hG, hU = (cute.make_rmem_tensor((per_row,), cutlass.BFloat16) for _ in range(2))
            hG.store(rG.load().to(cutlass.BFloat16))
            hU.store(rU.load().to(cutlass.BFloat16))
            silu_mul(hG, hU, rY[j])
            amax.append(group_amax(rY[j].load(), 4))
            if math_tidx % 4 == 0:
                r = tCcC[gate_up[j][0][0]][0]
                cute.arch.store_async_dsmem(sX.iterator + (slot * TILE_M + r), amax[j].bitcast(Int32), barrier,
                                            partner)  # fmt: skip
        cute.arch.mbarrier_wait(barrier, (visit // 2) % 2)
        # The wait acquires at CTA scope; the partner's stores released at cluster scope.
        cute.arch.fence_acq_rel_cluster()
        for j in cutlass.range_constexpr(len(gate_up)):
            r = tCcC[gate_up[j][0][0]][0]
            rQ = cute.make_rmem_tensor((per_row,), cutlass.Float8E4M3FN)
            scale = quantize_with_amax(rY[j].load(), cute.arch.fmax(amax[j], sX[r, slot]), rQ, self.ue8m0,
                                       correctly_rounded=False)  # fmt: skip
            row = m_tile * TILE_M + r
            if r < live_rows and row < mQ.shape[0]:
                for p in cutlass.range_constexpr(per_row // 2):
                    col = n_tile * (TILE_N // 2) + tCcC[gate_up[j][2 * p][0]][1]
                    cute.autovec_copy(cute.local_tile(rQ, (2,), (p,)), cute.local_tile(mQ[row, None], (2,), (col // 2,)))
                if partner == 1 and math_tidx % 4 == 0:
                    mQS[row, n_tile // 2] = scale
        cute.arch.sync_warp()

    @cute.jit
    def swiglu_epilogue(self, acc, tCcC, frag, sQ, tma_q, mQ, mQS, m_tile, n_tile, math_tidx):
        """swiglu: ``y = silu(gate) * up`` from the two halves' accumulators rounded to bf16, each
        row's 128 values one 1x128 group (a quad of lanes holds a row: 32 values each), quantized as
        ``silu_mul_quant`` does (``quantize_group_fp8``, x * 1/scale); the codes go through shared
        memory (``q_layout``'s swizzle, by hand: two adjacent codes per 16-bit store, a warp's 8 rows in 8
        different banks) to one TMA store of the 128 x 128 tile, the scales (one per row) straight to ``mQS``
        (MN-major: a tile's 128 scales are contiguous).  Rows past M_cap are clipped; padding rows
        get codes of whatever their accumulator rows held (unspecified, as the GEMM's own).
        ``frag``: each fragment element's row (``which_row``) and column offset (thread 0's column; a
        thread's columns are these plus its first one, below 8), known when tracing."""
        which_row, col_of = frag
        sQ, sQ_pairs = sQ
        barrier = pipeline.NamedBarrier(barrier_id=_EPI_BARRIER, num_threads=32 * _NUM_CONSUMER_WARPS)
        store_warp = math_tidx // 32 == 0
        if store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous tile's store has read sQ
        barrier.arrive_and_wait()
        per_row = cute.size(acc[0]) // (max(which_row) + 1)
        for j in cutlass.range_constexpr(max(which_row) + 1):
            elems = [i for i in range(cute.size(acc[0])) if which_row[i] == j]
            assert len(elems) == per_row
            # h rounded to bf16 as the plain GEMM stores it, then silu_mul_quant's own silu_mul: the
            # same codes and scales as the two kernels, bit for bit.
            rG, rU = (cute.make_rmem_tensor((per_row,), Float32) for _ in range(2))
            for t in cutlass.range_constexpr(per_row):
                rG[t], rU[t] = acc[0][elems[t]], acc[1][elems[t]]
            hG, hU = (cute.make_rmem_tensor((per_row,), cutlass.BFloat16) for _ in range(2))
            hG.store(rG.load().to(cutlass.BFloat16))
            hU.store(rU.load().to(cutlass.BFloat16))
            rY = cute.make_rmem_tensor((per_row,), Float32)
            silu_mul(hG, hU, rY)
            rQ = cute.make_rmem_tensor((per_row,), cutlass.Float8E4M3FN)
            scale = quantize_group_fp8(rY, rQ, 4, self.ue8m0, correctly_rounded=False)
            rQ_pairs = cute.recast_tensor(rQ, cutlass.Uint16)  # elements 2p, 2p + 1: adjacent columns
            r = tCcC[elems[0]][0]
            row_bytes = r * WGMMA_N + tCcC[0][1]  # the row's start plus this thread's first column
            r8 = r % 8
            for p in cutlass.range_constexpr(per_row // 2):
                # column = first + col_of (a multiple of 8 plus 0 or 1): its 16-byte chunk is col_of // 16
                chunk, within = divmod(col_of[elems[2 * p]], 16)
                sQ_pairs[(row_bytes + ((r8 ^ chunk) * 16) + within) // 2] = rQ_pairs[p]
            row = m_tile * TILE_M + r
            # Not past N either: pairs along N with I / 128 odd visit an N tile past the last one (it
            # feeds the multicast; the TMA store clips its codes).
            if math_tidx % 4 == 0 and row < mQS.shape[0] and n_tile < mQS.shape[1]:
                mQS[row, n_tile] = scale
        cute.arch.fence_proxy("async.shared", space="cta")
        barrier.arrive_and_wait()
        if store_warp:
            gQ = cute.local_tile(mQ, (TILE_M, WGMMA_N), (None, None))  # (128, 128, RestM, RestN)
            bSG_sQ, bSG_gQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                                   cute.group_modes(sQ, 0, 2),
                                                   cute.group_modes(gQ, 0, 2))  # fmt: skip
            cute.copy(tma_q, bSG_sQ, bSG_gQ[(None, m_tile, n_tile)])
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def epilogue(self, epi, tma_c, mC, m_tile, n_tile, math_tidx):
        """The tile in bf16: registers -> shared memory (stmatrix, 128 x 32 sub-tiles) -> TMA stores
        issued by one warp.  Store-behind: the whole tile, then its tile_n / 32 stores, waited for only
        before the next tile's epilogue rewrites the buffers (a K loop later: no wait in practice).
        Else two buffers, each reused once its sub-tile's store has read it."""
        copy_r2s, tRS_sC, tRS_rAcc, sub_shape, sC = epi
        gC = cute.zipped_divide(cute.local_tile(mC, (TILE_M, self.tile_n), (m_tile, n_tile)), (TILE_M, EPI_N))
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC)
        rD = cute.make_rmem_tensor(sub_shape, Float32)
        rD_out = cute.make_rmem_tensor(sub_shape, cutlass.BFloat16)
        barrier = pipeline.NamedBarrier(barrier_id=_EPI_BARRIER, num_threads=32 * _NUM_CONSUMER_WARPS)
        store_warp = math_tidx // 32 == 0
        if cutlass.const_expr(self.store_behind):
            if store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            barrier.arrive_and_wait()
        for sub in cutlass.range_constexpr(self.tile_n // EPI_N):
            buf = sub % self.epi_buffers
            half, sub_in_half = divmod(sub, WGMMA_N // EPI_N)
            for v in cutlass.range_constexpr(cute.size(rD)):
                rD[v] = tRS_rAcc[half][sub_in_half * cute.size(rD) + v]
            rD_out.store(rD.load().to(cutlass.BFloat16))
            cute.copy(copy_r2s, rD_out, tRS_sC[(None, None, None, buf)])
            if cutlass.const_expr(not self.store_behind):
                # Make the generic-proxy smem writes visible to the TMA (async proxy), store the
                # sub-tile, and wait until the other buffer has been read.
                cute.arch.fence_proxy("async.shared", space="cta")
                barrier.arrive_and_wait()
                if store_warp:
                    cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (0, sub))])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(self.epi_buffers - 1, read=True)
                barrier.arrive_and_wait()
        if cutlass.const_expr(self.store_behind):
            cute.arch.fence_proxy("async.shared", space="cta")
            barrier.arrive_and_wait()
            if store_warp:
                for sub in cutlass.range_constexpr(self.tile_n // EPI_N):
                    cute.copy(tma_c, bSG_sC[(None, sub)], bSG_gC[(None, (0, sub))])
                cute.arch.cp_async_bulk_commit_group()


@cached_compile
def compile_grouped_gemm_fp8(arch: str, keep_cubin: bool = False, block_scaled: bool = True, has_counts: bool = False,
                             along_m: bool = False, store_behind: bool = False, tile_n: int = TILE_N,
                             swiglu: bool = False, gate_first: bool = True, ue8m0: bool = False):  # fmt: skip
    """One binary for every M_cap, N, K, expert count and routing."""
    mA, mB, mSA, mSB, mOff, mC = fake_operands()
    mCnt = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)  # expert_counts, or offsets when unused
    if swiglu:  # FP8 codes [M_cap, I] and their MN-major scales
        mC = fake_tensor(cutlass.Uint8, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(divisibility=16), 1))
        mQS = fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), (1, cute.sym_int64(divisibility=4)), align=16)
    else:  # unused: the offsets stand in
        mQS = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    kernel = GroupedGemmFp8Sm90(block_scaled, has_counts, along_m, store_behind, tile_n, swiglu, gate_first, ue8m0)
    return compile_kernel(kernel, mA, mB, mSA, mSB, mOff, mC, mCnt, mQS, Int32(1), arch=arch, keep_cubin=keep_cubin)


def grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets, expert_counts=None, *, block_scaled: bool = True,
                          along_m: bool | None = None, store_behind: bool | None = None,
                          tile_n: int | None = None, expected_m: int | None = None,
                          op: str = "grouped_gemm_fp8"):  # fmt: skip
    """Launch on a's device and current stream; inputs validated by the op layer (``op``: the op the
    launch's errors name).

    ``expert_counts`` (optional, int32 [E]): real rows per segment (``align``'s fourth output);
    a warp group whose 64 rows of a tile are all past the count skips its math, and a tile with at
    most ``SPARSE_ROWS`` real rows writes those rows only: padding rows are unspecified.
    ``block_scaled=False`` is the benchmark's no-promotion variant (scales ignored).  ``along_m``,
    ``store_behind``, ``tile_n``: the cluster direction, the epilogue and the tile's width
    (``sm90_launch_config``: chosen from the shapes and ``expected_m`` when None; tests and
    benchmarks force them)."""
    has_counts = expert_counts is not None
    along_m, store_behind, tile_n = sm90_launch_config(a.shape[0], b.shape[0], a.shape[1], has_counts, along_m,
                                                       store_behind, tile_n, expected_m)  # fmt: skip
    key = ("sm_90a", False, block_scaled, has_counts, along_m, store_behind, tile_n)
    return _launch(key, a, a_scale, b, b_scale, expert_offsets, expert_counts, expert_offsets, op=op)


def _launch(key: tuple, a, a_scale, b, b_scale, expert_offsets, expert_counts, scales_out, out=None,
            op: str = "grouped_gemm_fp8"):  # fmt: skip
    """``launch`` of ``compile_grouped_gemm_fp8(*key)`` with its grid (pairs along M or N: ``key``'s
    along_m, tile width ``key[6]``); ``scales_out``: the kernel's ``mQS`` (the SwiGLU scales, or any
    int32 tensor: the offsets)."""
    along_m, tile_n = key[4], key[6]
    if along_m:
        grid_fn = functools.partial(pair_launch_grid, tile_n=tile_n)
    else:
        grid_fn = functools.partial(launch_grid, cluster_n=CLUSTER_N, tile_n=tile_n)
    return launch("sm_90a", lambda: compile_grouped_gemm_fp8(*key), CLUSTER_N, a, a_scale, b, b_scale, expert_offsets,
                  (expert_offsets if expert_counts is None else expert_counts, scales_out), grid_fn=grid_fn, out=out,
                  op=op)  # fmt: skip


def grouped_gemm_fp8_swiglu_cuda(a, a_scale, b, b_scale, expert_offsets, expert_counts=None, gate_first: bool = True,
                                 scale_fmt: str | None = None, expected_m: int | None = None,
                                 tile_n: int | None = None):  # fmt: skip
    """The w13 GEMM and ``silu_mul_quant`` in one kernel: ``(q [M_cap, I] e4m3, scales [M_cap, I/128] f32,
    MN-major)`` from ``b`` = w13 [E, 2I, K].  Its caller (``grouped_gemm_swiglu``) launches it where
    ``sm90_swiglu_tile`` gives a width (the shapes its GPU tests cover; ``tile_n`` forces one) and
    runs the two kernels elsewhere.  256 wide, where the plain GEMM would store behind (K <= 2048),
    this one keeps its 4 stages: its one 16 KB TMA store per tile is waited for only by the next
    tile's epilogue, which is what the store-behind epilogue buys for the bf16 tile.  128 wide: the
    plain GEMM's variant (pairs along N, 6 stages), the pair's CTAs exchanging each row's amax.
    Numerics: the two kernels', bit for bit (h rounded to bf16, then ``silu_mul_quant``'s silu and
    quantizer).  256 wide, codes and scales of every row of a visited tile are written, padding rows
    included; 128 wide with counts, the real rows' only (padding rows: unspecified either way)."""
    has_counts = expert_counts is not None
    (m_cap, k), inter = a.shape, b.shape[1] // 2
    if tile_n is None:
        tile_n = sm90_swiglu_tile(m_cap, b.shape[0], k, has_counts, expected_m)
        if tile_n is None:
            raise ValueError("cute_moe.grouped_gemm_fp8_swiglu: no one-kernel sm90 variant for this launch "
                             "(sm90_swiglu_tile): the op runs grouped_gemm_fp8 and silu_mul_quant")  # fmt: skip
    check_sm90_variant(tile_n)
    along_m = tile_n == WIDE_TILE_N and cluster_along_m(m_cap, b.shape[0], k, True, has_counts, expected_m)
    q = torch.empty(m_cap, inter, dtype=torch.float8_e4m3fn, device=a.device)
    scales = empty_mn_major(m_cap, inter // WGMMA_N, a.device)
    key = ("sm_90a", False, True, has_counts, along_m, False, tile_n, True, gate_first, scale_fmt == "ue8m0")
    _launch(key, a, a_scale, b, b_scale, expert_offsets, expert_counts, scales, out=q.view(torch.uint8),
            op="grouped_gemm_fp8_swiglu")
    return q, scales


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes); the kernel exists for sm_90a only."""
    if arch != "sm_90a":
        return []
    out = []
    for along_m, store_behind, counts, tile_n in ((False, False, False, TILE_N), (False, False, True, TILE_N),
                                                  (True, False, True, TILE_N), (False, True, True, TILE_N),
                                                  (False, False, False, WIDE_TILE_N), (False, False, True, WIDE_TILE_N),
                                                  (True, False, False, WIDE_TILE_N), (True, False, True, WIDE_TILE_N),
                                                  (False, True, False, WIDE_TILE_N), (True, True, False, WIDE_TILE_N),
                                                  (False, True, True, WIDE_TILE_N)):  # fmt: skip
        kernel = GroupedGemmFp8Sm90(True, counts, along_m, store_behind, tile_n)
        accumulators = "2 temporary accumulators" if tile_n == TILE_N else "2 halves through 1 temporary accumulator"
        name = (f"grouped_gemm_fp8[sm90, persistent, 128x{tile_n}x128, {kernel.stages} stages, {accumulators}, "
                f"cluster {'2x1 (B shared)' if along_m else '1x2 (A shared)'}"
                f"{', store-behind epilogue' if store_behind else ''}{', expert_counts' if counts else ''}]")  # fmt: skip
        out.append((name, compile_grouped_gemm_fp8(arch, True, True, counts, along_m, store_behind, tile_n),
                    kernel.dynamic_smem_bytes))  # fmt: skip
    return out


def inspect_swiglu_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) of the SwiGLU variants fused_moe's w13 GEMM runs,
    with expert counts: 256 wide at prefill, pairs along M (>= 1 real tile per expert) or along N;
    128 wide at decode sizes (pairs along N)."""
    if arch != "sm_90a":
        return []
    out = []
    for along_m, tile_n in ((True, WIDE_TILE_N), (False, WIDE_TILE_N), (False, TILE_N)):
        kernel = GroupedGemmFp8Sm90(True, True, along_m, False, tile_n, True)
        group = "half a 1x128 group per tile, amax exchanged in the pair" if tile_n == TILE_N else "1x128 groups"
        name = (f"grouped_gemm_fp8_swiglu[sm90, persistent, 128x{tile_n}x128 (gate | up), {kernel.stages} stages, "
                f"cluster {'2x1 (B shared)' if along_m else '1x2 (A shared)'}, expert_counts, FP8 out, {group}]")  # fmt: skip
        out.append((name, compile_grouped_gemm_fp8(arch, True, True, True, along_m, False, tile_n, True),
                    kernel.dynamic_smem_bytes))  # fmt: skip
    return out


__all__ = ["GroupedGemmFp8Sm90", "ROW_ALIGNMENT", "compile_grouped_gemm_fp8", "grouped_gemm_fp8_cuda",
           "grouped_gemm_fp8_swiglu_cuda"]
