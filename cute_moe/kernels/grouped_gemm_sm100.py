"""Blackwell (sm_100a) grouped FP8 GEMM with 1x128 / 128x128 block scales.

Status: **compiled and SASS-inspected for sm_100a; never run on hardware.**  No
Blackwell GPU is available to this project, so the kernel is checked only by its
compile + SASS test (``tests/test_compile_grouped_gemm_sm100.py``: UTCQMMA,
UTMALDG (A by multicast)/UTMASTG, the multicast MMA commit and the cluster barrier, LDTM,
no local memory, shared and tensor memory budgets) and by a pure-Python model of its
tile schedule.  ``tests/test_gpu_grouped_gemm_sm100.py``
holds the GPU acceptance test, skipped everywhere but a compute-capability-10.0 GPU.
``torch.ops.cute_moe.grouped_gemm_fp8`` runs this kernel on sm_100a devices (``grouped_gemm.py``)
and warns, once per process, that it has not run on hardware before; run that test first.

Math (``reference.grouped_gemm_fp8_ref``), for every row ``r`` of expert ``e``'s
segment ``[off[e], off[e+1])`` and column ``n``::

    C[r, n] = sum_kb  a_scale[r, kb] * b_scale[e, n // 128, kb]
                      * sum_{k in block kb} A[r, k] * B[e, n, k]      (f32), bf16 out

Each 128-wide K block's FP8 product is accumulated by tcgen05 MMA into its own
tensor-memory (TMEM) buffer with accumulation reset (``ACCUMULATE=False`` on the
block's first MMA), then promoted into an f32 running accumulator held in
registers: ``acc += block * (a_scale[r, kb] * b_scale[e, n_blk, kb])``.  Scaling
is done in f32 by CUDA cores, never inside the tensor core's accumulator.

Pipeline (one CTA per SM, persistent, 11 warps, clusters of ``CLUSTER_N`` = 2 CTAs on
adjacent N tiles of one M tile):
* warp 9 (TMA): per K block, into one of ``AB_STAGES`` shared-memory stages
  (``PipelineTmaUmma``: transaction-count full barriers, MMA-commit empty barriers):
  the CTA's half of the A tile (64 x 128, TMA multicast to both CTAs of the cluster, so
  each CTA's stage receives the whole 128 x 128 A tile and its full barrier both halves'
  bytes) and its own B tile (128 x 128 of expert ``e``).
* warp 10 (scales): per K block, ``cp.async`` of the tile's 128 A scales (a_scale
  is MN-major, so they are 512 contiguous bytes: 16 bytes per lane) and the one B
  scale into one of ``SCALE_STAGES`` stages (``PipelineCpAsync``; many stages,
  because the scales' latency is that of global memory while they are tiny).
* warp 8 (MMA): per K block, 4 ``tcgen05.mma`` 128x128x32 e4m3 (kind::f8f6f4)
  from shared memory into TMEM buffer ``k % ACC_STAGES`` (1-CTA MMA, ``cta_group::1``),
  then ``tcgen05.commit`` multicast to the stage's empty barrier in both CTAs (the
  partner wrote half of it) and a local ``tcgen05.commit`` to publish the TMEM buffer
  (``PipelineUmmaAsync``).
* warps 0-7 (accumulator update + epilogue), two warp groups splitting the 128
  columns (64 each, so every SM sub-partition holds two of them and one's TMEM
  load latency hides behind the other's FMAs): per K block, ``tcgen05.ld``
  (32dp32b, thread = accumulator row), release the TMEM buffer, one scale product
  per thread (row scale x block scale), 64 FFMA into the running accumulator.
  After the tile's last K block: bf16 conversion, store to shared memory, TMA
  store of 128 x 32 sub-tiles (out-of-range columns of the last N tile, e.g.
  N = 2112, are clipped by TMA).  The MMA warp meanwhile runs ahead into the next
  tile as far as the ``ACC_STAGES`` TMEM buffers allow, so the epilogue overlaps
  the next tile's main loop.

Cluster synchronization (it cannot be run here, so the argument is written down):
* Barrier init before any cross-CTA traffic: every pipeline is created with
  ``defer_sync``; then ``fence.mbarrier_init.release.cluster`` and ``barrier.cluster``
  arrive (relaxed) / wait by every thread of both CTAs, before any role starts.  No
  multicast or remote arrive can reach a barrier that is not initialised.
* Lockstep: both CTAs walk the same tile-group sequence (same cluster index, the same
  ``expert_offsets``), so K block ``j`` uses stage ``j % AB_STAGES`` in both.  A stage's
  empty barrier counts ``CLUSTER_N`` arrivals, one multicast commit from each CTA's MMA
  warp, so a producer refills stage ``s`` (its multicast writes the partner's stage
  too) only when both MMA warps have finished reading both copies.  A CTA's full
  barrier completes only when its producer's arrive-with-expect (32 KB) and the bytes of
  both A halves and its B have landed; a partner's bytes that land before that arrive
  cannot complete the phase (one arrival is still pending), and they cannot belong to
  the next phase (the partner refills only after this CTA's MMA released the stage,
  i.e. after this phase completed).
* Exit: a CTA exits only after (a) its MMA warp waited on every full barrier, so every
  multicast write of the partner into it has landed, and (b) its TMA warp's
  ``producer_tail`` waited until the last ``AB_STAGES`` stages were released by both
  MMA warps, so no commit of the partner can still arrive on its barriers (earlier
  releases were awaited by the producer's own acquires).  TMEM, the scale and the
  accumulator pipelines are per CTA.

TMEM: ``ACC_STAGES`` (4) x 128 columns = all 512 columns, allocated by warp 0,
permit relinquished at once (one CTA per SM by construction: shared memory), freed
by warp 0 after every accumulator warp has passed its last ``tcgen05.ld``.

Tile schedule (``grouped_gemm_schedule``, the sm_90a kernel's with pairs along N -- that kernel
pairs M tiles instead at prefill MoE shapes, this one never; its
``tile_schedule(..., cluster_n=2)`` is the executable model, tested on the CPU): the host
launches ``launch_grid(M_cap, N, #SMs, 2)`` CTAs, an even number; tile groups (one M tile,
two adjacent N tiles) are numbered ``t = m_tile * n_groups + group`` with ``n_groups =
ceil(N / 256)`` (N fastest), and cluster ``c`` (CTAs ``2c`` and ``2c + 1``, ranks 0 and 1)
visits ``t = c, c + grid / 2, ...`` below ``ceil(expert_offsets[-1] / 128) * n_groups``,
read on the device, so no tile past the last segment is ever visited; rank ``r`` takes N
tile ``2 group + r``.  When N has an odd number of 128-column tiles, rank 1 of the last
group lies past N: that visit only feeds the partner its A half (its B box is wholly out
of bounds, zero-filled by TMA with its bytes counted; its B scale copy is skipped; its
store is clipped by TMA to nothing).  Each role walks the same sequence and finds a
tile's expert by counting ``expert_offsets[1:] <= 128 m`` (a warp sum).  Nothing about the
routing, M_cap, N, K or E is a compile-time constant: one binary serves all.

Choices:
* 1-CTA 128x128 tiles.  N = 128 matches the B-scale block, so one B scale per K block
  covers the tile; 128 rows match the segment padding, so a tile never straddles
  experts.  A 128x256 tile would need two B scales per K block and 256 f32 accumulator
  registers per row-thread or a TMEM-resident running sum.
* Clusters of 2 along N sharing A by multicast (halves each CTA's A traffic from L2:
  the pair reads 48 KB per K block instead of 64 KB).  Along N this is always valid in a
  grouped GEMM: both CTAs hold the same M tile, hence the same rows of A and the same
  expert, whatever the routing; only the N tile differs, and a missing partner tile
  (odd tile count) becomes a multicast-only visit.  B multicast along M is not: two M
  tiles of a cluster may lie in different experts' segments (a segment boundary between
  them, or an expert with a single M tile), and their B tiles then differ; it would
  need a pairing rule in the ragged schedule (pairs of M tiles of one expert, padding
  visits otherwise).  2-CTA MMA (``cta_group::2``, 256-row pairs) has the same M-pairing
  problem; both are later steps, to be taken once this version has run on hardware.
* Running accumulator in registers (64 f32 per thread), not in TMEM: promotion
  then costs one ``tcgen05.ld`` per K block instead of a load and a store.
* The update warps do the epilogue themselves (the running sum is already in their
  registers), through one 8 KB shared-memory buffer per warp group: a second one
  per group would cost an A/B stage of the 227 KB.

Constraints: K % 128 == 0; N % 8 == 0; M_cap % 128 == 0 and every segment length
a multiple of 128 (``align(..., alignment=128)``); a tile of a segment that breaks
this is written as NaN, never as a plausible wrong answer (as the sm_90a kernel
does).  A, B K-major with 16-byte aligned rows; a_scale MN-major with a 16-byte
aligned base and column stride.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ..compiler import cached_compile, compile_kernel
from .grouped_gemm_schedule import (
    CLUSTER_N, TILE_K, TILE_M, TILE_N, can_implement, expert_of_row, fake_operands, fp8_operands, launch, load_scales,
    tile_coords, valid_tiles,
)  # fmt: skip

EPI_N = 32  # epilogue sub-tile: 128 x 32 bf16 (8 KB), one TMA store each
AB_STAGES = 6  # 6 x 32 KB of A + B
SCALE_STAGES = 12  # 12 x 516 B: covers global latency at one stage per K block
ACC_STAGES = 4  # TMEM buffers of 128 f32 columns each
TMEM_COLUMNS = ACC_STAGES * TILE_N  # 512: the whole tensor memory of the SM
_ACC_WARP_GROUPS = 2  # accumulator-update warp groups, 64 columns each
_COLS_PER_GROUP = TILE_N // _ACC_WARP_GROUPS
_SUBTILES_PER_GROUP = _COLS_PER_GROUP // EPI_N
_MMA_WARP, _TMA_WARP, _SCALE_WARP = 8, 9, 10
_NUM_THREADS = 32 * 11
_ACC_THREADS = 128 * _ACC_WARP_GROUPS
# Named barriers (0 is __syncthreads): TMEM address hand-off, per-group epilogue, TMEM free.
_TMEM_ALLOC_BARRIER, _EPI_BARRIER_BASE, _ACC_DONE_BARRIER = 1, 2, 2 + _ACC_WARP_GROUPS


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


class GroupedGemmFp8Sm100:
    """Static configuration (dtypes are fixed: e4m3 in, f32 accumulation and scales, bf16 out)."""

    num_threads = _NUM_THREADS
    can_implement = staticmethod(can_implement)

    def __init__(self):
        # Layout of SharedStorage below: barriers and the TMEM address, scales (16-byte aligned),
        # then C, A and B stages (1024-byte aligned for their swizzles).
        head = 8 * 2 * (AB_STAGES + SCALE_STAGES + ACC_STAGES) + 4
        head = _round_up(head, 16) + 4 * TILE_M * SCALE_STAGES
        head = _round_up(head, 16) + 4 * SCALE_STAGES
        c_bytes = 2 * TILE_M * EPI_N * _ACC_WARP_GROUPS
        ab_bytes = AB_STAGES * (TILE_M + TILE_N) * TILE_K
        self.dynamic_smem_bytes = _round_up(head, 1024) + c_bytes + ab_bytes

    @cute.jit
    def __call__(self, mA, mB, mSA, mSB, mOff, mC, num_ctas: Int32, stream):
        fp8 = cutlass.Float8E4M3FN
        mA, mB = fp8_operands(mA, mB)  # (M_cap, K), (N, K, E)
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            fp8, fp8, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            tcgen05.CtaGroup.ONE, (TILE_M, TILE_N),
        )  # fmt: skip
        mma_tiler = (TILE_M, TILE_N, TILE_K)
        sA_layout = sm100_utils.make_smem_layout_a(tiled_mma, mma_tiler, fp8, AB_STAGES)
        sB_layout = sm100_utils.make_smem_layout_b(tiled_mma, mma_tiler, fp8, AB_STAGES)
        epi_tile = (TILE_M, EPI_N)
        sC_layout = sm100_utils.make_smem_layout_epi(
            cutlass.BFloat16, LayoutEnum.ROW_MAJOR, epi_tile, _ACC_WARP_GROUPS
        )
        # The cluster's CTAs lie along N (1-CTA MMA: no V extent): A is split into CLUSTER_N slices,
        # each loaded by one CTA and multicast to all of them; B is loaded by each CTA for itself.
        cluster_vmnk = (1, 1, CLUSTER_N, 1)
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            cpasync.CopyBulkTensorTileG2SMulticastOp(tcgen05.CtaGroup.ONE), mA,
            cute.slice_(sA_layout, (None, None, None, 0)), mma_tiler, tiled_mma, cluster_vmnk,
        )  # fmt: skip
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE), mB,
            cute.slice_(sB_layout, (None, None, None, 0)), mma_tiler, tiled_mma, cluster_vmnk,
        )  # fmt: skip
        # The TMA store clips what lies past N (e.g. N = 2112) and writes nothing for a
        # multicast-only visit past the last N tile.
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)), epi_tile
        )

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, AB_STAGES * 2]
            scale_barriers: cute.struct.MemRange[cutlass.Int64, SCALE_STAGES * 2]
            acc_barriers: cute.struct.MemRange[cutlass.Int64, ACC_STAGES * 2]
            tmem_address: Int32
            sSFA: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * SCALE_STAGES], 16]
            sSFB: cute.struct.Align[cute.struct.MemRange[Float32, SCALE_STAGES], 16]
            sC: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sC_layout.outer)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sA_layout.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sB_layout.outer)], 1024]

        assert SharedStorage.size_in_bytes() == self.dynamic_smem_bytes, (
            SharedStorage.size_in_bytes(), self.dynamic_smem_bytes)  # fmt: skip
        self.shared_storage = SharedStorage
        self.kernel(
            tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, mSA, mSB, mOff,
            sA_layout, sB_layout, sC_layout,
        ).launch(grid=[num_ctas, 1, 1], block=[self.num_threads, 1, 1], cluster=[CLUSTER_N, 1, 1], min_blocks_per_mp=1,
                 stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(self, tiled_mma, tma_a, mA, tma_b, mB, tma_c, mC, mSA, mSB, mOff, sA_layout, sB_layout, sC_layout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # The CTA's rank in its cluster is its N coordinate there (1-CTA MMA: the V extent is 1).
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_layout = cute.make_layout((1, 1, CLUSTER_N, 1))  # (V, M, N, K) -> rank
        # The CTAs with this CTA's M coordinate: all of the cluster (0b11), the A multicast's targets.
        a_mcast_mask = cpasync.create_tma_multicast_mask(
            cluster_layout, cluster_layout.get_flat_coord(rank), mcast_mode=2
        )
        if warp_idx == _TMA_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        one_cta = cute.make_layout((1, 1, 1, 1))
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=AB_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # A stage is free once the MMA warps of both CTAs have read it (the partner multicasts
            # into it): each MMA warp's tcgen05.commit arrives on this stage's empty barrier in every
            # CTA of the cluster (the pipeline's consumer mask, 0b11, from cta_layout_vmnk).
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CLUSTER_N),
            # Per CTA and stage: the whole A tile (its own slice and the partner's) and its B tile.
            tx_count=cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sA_layout, (None, None, None, 0)))
            + cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sB_layout, (None, None, None, 0))),
            cta_layout_vmnk=cluster_layout,
            defer_sync=True,
        )
        scale_pipe = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.scale_barriers.data_ptr(),
            num_stages=SCALE_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),  # one cp.async arrive per lane
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _ACC_THREADS),
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_barriers.data_ptr(),
            num_stages=ACC_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),  # one tcgen05.commit
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _ACC_THREADS // 32),  # one per warp
            cta_layout_vmnk=one_cta,  # the CTA's own TMEM and barriers: nothing crosses the cluster
            defer_sync=True,
        )
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=_TMEM_ALLOC_BARRIER, num_threads=_ACC_THREADS + 32),
            allocator_warp_id=0,
        )
        # Both CTAs' barrier inits are visible cluster-wide (fence.mbarrier_init.release.cluster, then
        # barrier.cluster arrive/wait by every thread of both CTAs) before either CTA multicasts into
        # the other or arrives on its barriers.
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, CLUSTER_N), is_relaxed=True)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        sSFA = storage.sSFA.get_tensor(cute.make_layout((TILE_M, SCALE_STAGES)))
        sSFB = storage.sSFB.get_tensor(cute.make_layout((1, SCALE_STAGES)))

        # Persistent schedule (grouped_gemm_schedule.tile_schedule models it): cluster c visits the
        # tile groups t = c, c + clusters, ... below the last segment's end (clamped to M_cap), N
        # fastest; group t is M tile t // n_groups and N tiles CLUSTER_N * (t % n_groups) + rank.
        # Every role of both CTAs walks the same sequence, so their pipelines stay in step.
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        num_experts = mOff.shape[0] - 1
        n_groups = (mC.shape[1] + TILE_N * CLUSTER_N - 1) // (TILE_N * CLUSTER_N)
        k_tiles = mA.shape[1] // TILE_K
        sched = (bidx // CLUSTER_N, valid_tiles(mOff, num_experts, mA.shape[0], n_groups), grid // CLUSTER_N,
                 n_groups, k_tiles, rank)  # fmt: skip

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, CLUSTER_N))

        if warp_idx == _TMA_WARP:
            self.load_ab(tiled_mma, tma_a, mA, tma_b, mB, sA, sB, ab_pipe, mOff, num_experts, lane, a_mcast_mask,
                         sched)  # fmt: skip
        if warp_idx == _SCALE_WARP:
            load_scales(mSA, mSB, sSFA, sSFB, scale_pipe, SCALE_STAGES, mOff, num_experts, lane, sched)
        if warp_idx == _MMA_WARP:
            tmem.wait_for_alloc()
            tCtAcc = cute.make_tensor(tmem.retrieve_ptr(Float32), self.acc_layout(tiled_mma))
            self.mma(tiled_mma, sA, sB, tCtAcc, ab_pipe, acc_pipe, sched)
        if warp_idx < _MMA_WARP:
            tmem.allocate(TMEM_COLUMNS)
            tmem.relinquish_alloc_permit()  # nothing else allocates: let the hardware know now
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            tCtAcc = cute.make_tensor(tmem_ptr, self.acc_layout(tiled_mma))
            self.update_and_store(tCtAcc, tma_c, mC, sC, sSFA, sSFB, acc_pipe, scale_pipe, mOff, num_experts, lane,
                                  warp_idx, sched)  # fmt: skip
            # Every accumulator warp has waited for its last tcgen05.ld: the columns can go.
            pipeline.NamedBarrier(barrier_id=_ACC_DONE_BARRIER, num_threads=_ACC_THREADS).arrive_and_wait()
            tmem.free(tmem_ptr, TMEM_COLUMNS)

    def acc_layout(self, tiled_mma):
        """(MMA, MMA_M, MMA_N, ACC_STAGES) f32 accumulators in TMEM, 128 columns per stage."""
        acc_shape = tiled_mma.partition_shape_C((TILE_M, TILE_N))
        return tiled_mma.make_fragment_C(cute.append(acc_shape, ACC_STAGES)).layout

    @cute.jit
    def load_ab(self, tiled_mma, tma_a, mA, tma_b, mB, sA, sB, ab_pipe, mOff, num_experts, lane, a_mcast_mask, sched):
        """TMA warp: per K block, this CTA's slice of the A tile (multicast to both CTAs of the
        cluster: each CTA's stage receives the whole tile) and expert e's B tile into one stage."""
        first_tile, valid_tiles, tile_stride, n_groups, k_tiles, rank = sched
        thr_mma = tiled_mma.get_slice(0)
        # (MMA, MMA_M, MMA_K, RestM, RestK) and (MMA, MMA_N, MMA_K, RestN, RestK, E)
        tCgA = thr_mma.partition_A(cute.local_tile(mA, (TILE_M, TILE_K), (None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, (TILE_N, TILE_K), (None, None, None)))
        # Slice `rank` of CLUSTER_N along the A tile's rows (rank = the CTA's N coordinate in the cluster).
        tAsA, tAgA = cpasync.tma_partition(
            tma_a, rank, cute.make_layout(CLUSTER_N), cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
        )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, AB_STAGES)
        for tile in cutlass.range(first_tile, valid_tiles, tile_stride, unroll=1):
            # Past the last N tile (an odd count, rank 1 of the last group) the B box lies wholly
            # outside B: TMA fills it with zeros and still counts its bytes; this visit only feeds
            # the partner its A slice.
            m_tile, n_tile = tile_coords(tile, n_groups, rank)
            expert = expert_of_row(mOff, m_tile * TILE_M, num_experts, lane)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                # The stage is free in both CTAs: both MMA warps' commits arrived on our empty barrier.
                ab_pipe.producer_acquire(state)  # then arrive + expect the whole stage's bytes
                # The multicast signals this barrier's twin (same offset) in every CTA it writes to.
                barrier = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, tAgA[(None, m_tile, k_tile)], tAsA[(None, state.index)], tma_bar_ptr=barrier,
                          mcast_mask=a_mcast_mask)  # fmt: skip
                cute.copy(tma_b, tBgB[(None, n_tile, k_tile, expert)], tBsB[(None, state.index)], tma_bar_ptr=barrier)
                state.advance()
        # Before exit, wait until the last AB_STAGES stages are released by both MMA warps: then no
        # commit of the partner's can still arrive on this CTA's barriers (and, because every one
        # of those stages was also full in the partner, no multicast of ours is still in flight).
        ab_pipe.producer_tail(state)

    @cute.jit
    def mma(self, tiled_mma, sA, sB, tCtAcc, ab_pipe, acc_pipe, sched):
        """MMA warp: per K block, 4 tcgen05 MMAs into a fresh TMEM buffer."""
        first_tile, valid_tiles, tile_stride, _, k_tiles, _ = sched
        tCrA = tiled_mma.make_fragment_A(sA)  # (MMA, MMA_M, MMA_K, STAGE) smem descriptors
        tCrB = tiled_mma.make_fragment_B(sB)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, AB_STAGES)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
        for _tile in cutlass.range(first_tile, valid_tiles, tile_stride, unroll=1):
            for _k in cutlass.range(k_tiles, unroll=1):
                acc_pipe.producer_acquire(acc_state)
                ab_pipe.consumer_wait(ab_state)
                tCtAcc_k = tCtAcc[(None, None, None, acc_state.index)]
                # A fresh product per K block: its scales differ from the previous block's.
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    coord = (None, None, kb, ab_state.index)
                    cute.gemm(tiled_mma, tCtAcc_k, tCrA[coord], tCrB[coord], tCtAcc_k)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                # tcgen05.commit multicast to both CTAs' empty barriers of this stage: it is free once
                # these MMAs have read it (and the partner's have read its twin).
                ab_pipe.consumer_release(ab_state)
                acc_pipe.producer_commit(acc_state)  # tcgen05.commit: TMEM buffer full once they complete
                ab_state.advance()
                acc_state.advance()
        # acc_pipe.producer_tail(acc_state), for every CTA: the library's skips odd cluster ranks (it
        # assumes pairs of 2-CTA MMA).  Wait until the update warps have released the last buffer.
        for _ in cutlass.range_constexpr(ACC_STAGES - 1):
            acc_state.advance()
        acc_pipe.producer_acquire(acc_state)

    @cute.jit
    def update_and_store(self, tCtAcc, tma_c, mC, sC, sSFA, sSFB, acc_pipe, scale_pipe, mOff, num_experts, lane,
                         warp_idx, sched):  # fmt: skip
        """Warps 0-7: promote each K block's product into the f32 running sum, then the bf16 epilogue."""
        first_tile, valid_tiles, tile_stride, n_groups, k_tiles, rank = sched
        tidx, _, _ = cute.arch.thread_idx()
        group = warp_idx // 4  # columns [64 group, 64 group + 64) of the tile
        epi_tidx = tidx % 128
        epi_tile = (TILE_M, EPI_N)

        # TMEM -> registers: 32 data paths x 32 bits, so thread i of the group owns accumulator row i.
        tAcc_epi = cute.flat_divide(tCtAcc[((None, None), 0, 0, None)], epi_tile)  # (128, 32, 1, 4, ACC_STAGES)
        tiled_t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(EPI_N)), Float32),
            tAcc_epi[(None, None, 0, 0, 0)],
        )
        thr_t2r = tiled_t2r.get_slice(epi_tidx)
        tTR_tAcc = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, T2R_N, 1, 4, ACC_STAGES)
        tTR_cC = thr_t2r.partition_D(cute.make_identity_tensor(epi_tile))
        row = tTR_cC[0][0]
        tTR_rBlock = [cute.make_rmem_tensor(tTR_cC.shape, Float32) for _ in range(_SUBTILES_PER_GROUP)]
        tTR_rAcc = [cute.make_rmem_tensor(tTR_cC.shape, Float32) for _ in range(_SUBTILES_PER_GROUP)]

        # Registers -> shared memory (one 128 x 32 buffer per group) -> TMA store.
        tiled_r2s = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, Float32, tiled_t2r),
            tiled_t2r,
        )
        tRS_sC = tiled_r2s.get_slice(epi_tidx).partition_D(sC)  # (R2S, R2S_M, R2S_N, groups)
        tTR_rC = cute.make_rmem_tensor(tTR_cC.shape, cutlass.BFloat16)
        tRS_rC = tiled_r2s.retile(tTR_rC)
        is_store_warp = warp_idx % 4 == 0
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=1, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
        )
        epi_barrier = pipeline.NamedBarrier(barrier_id=_EPI_BARRIER_BASE + group, num_threads=128)

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCALE_STAGES)
        for tile in cutlass.range(first_tile, valid_tiles, tile_stride, unroll=1):
            m_tile, n_tile = tile_coords(tile, n_groups, rank)  # past N: the TMA store writes nothing
            for j in cutlass.range_constexpr(_SUBTILES_PER_GROUP):
                tTR_rAcc[j].fill(0.0)
            for _k in cutlass.range(k_tiles, unroll=1):
                acc_pipe.consumer_wait(acc_state)
                for j in cutlass.range_constexpr(_SUBTILES_PER_GROUP):
                    subtile = group * _SUBTILES_PER_GROUP + j
                    cute.copy(tiled_t2r, tTR_tAcc[(None, None, None, 0, subtile, acc_state.index)], tTR_rBlock[j])
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: registers valid, TMEM buffer read
                with cute.arch.elect_one():
                    acc_pipe.consumer_release(acc_state)
                acc_state.advance()

                scale_pipe.consumer_wait(scale_state)
                scale = sSFA[row, scale_state.index] * sSFB[0, scale_state.index]
                scale_pipe.consumer_release(scale_state)
                scale_state.advance()
                for j in cutlass.range_constexpr(_SUBTILES_PER_GROUP):
                    for i in cutlass.range_constexpr(cute.size(tTR_rAcc[j])):
                        tTR_rAcc[j][i] = tTR_rBlock[j][i] * scale + tTR_rAcc[j][i]

            # A segment that is not a multiple of 128 rows would mix experts in this tile: NaN, not
            # plausible wrong values.
            expert = expert_of_row(mOff, m_tile * TILE_M, num_experts, lane)
            misaligned = (mOff[expert] % TILE_M) | (mOff[expert + 1] % TILE_M)
            if misaligned != 0:
                for j in cutlass.range_constexpr(_SUBTILES_PER_GROUP):
                    tTR_rAcc[j].fill(float("nan"))
            gC_epi = cute.flat_divide(cute.local_tile(mC, (TILE_M, TILE_N), (m_tile, n_tile)), epi_tile)
            bSG_sC, bSG_gC = cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC_epi, 0, 2)
            )  # ((ATOM, REST), groups) and ((ATOM, REST), 1, 4)
            for j in cutlass.range_constexpr(_SUBTILES_PER_GROUP):
                if is_store_warp:
                    c_pipe.producer_acquire()  # the group's buffer has been read by its previous store
                epi_barrier.arrive_and_wait()
                tRS_rC.store(tiled_r2s.retile(tTR_rAcc[j]).load().to(cutlass.BFloat16))
                cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, group)])
                cute.arch.fence_proxy("async.shared", space="cta")  # st.shared visible to the TMA engine
                epi_barrier.arrive_and_wait()
                if is_store_warp:
                    cute.copy(tma_c, bSG_sC[(None, group)], bSG_gC[(None, 0, group * _SUBTILES_PER_GROUP + j)])
                    c_pipe.producer_commit()
        if is_store_warp:
            c_pipe.producer_tail()


@cached_compile
def compile_grouped_gemm_fp8_sm100(arch: str, keep_cubin: bool = False):
    """One binary for every M_cap, N, K, expert count, routing and grid size."""
    mA, mB, mSA, mSB, mOff, mC = fake_operands()
    return compile_kernel(
        GroupedGemmFp8Sm100(), mA, mB, mSA, mSB, mOff, mC, Int32(1), arch=arch, keep_cubin=keep_cubin
    )


def grouped_gemm_fp8_sm100_cuda(a, a_scale, b, b_scale, expert_offsets, op: str = "grouped_gemm_fp8"):
    """Launch on a's device and current stream; inputs validated by the op layer."""
    return launch("sm_100a", lambda: compile_grouped_gemm_fp8_sm100("sm_100a"), CLUSTER_N, a, a_scale, b, b_scale,
                  expert_offsets, op=op)  # fmt: skip


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes); the kernel exists for sm_100a only."""
    if arch != "sm_100a":
        return []
    return [(f"grouped_gemm_fp8[sm100, 128x128x128, 1x{CLUSTER_N} cluster (A multicast), {AB_STAGES}+{SCALE_STAGES} "
             f"stages, {ACC_STAGES} TMEM buffers]",
             compile_grouped_gemm_fp8_sm100(arch, True), GroupedGemmFp8Sm100().dynamic_smem_bytes)]  # fmt: skip
