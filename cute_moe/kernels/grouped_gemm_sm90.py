"""Hopper (sm_90a) grouped FP8 GEMM with 1x128 / 128x128 block scales — version 0.

Status: compiled and SASS-checked for sm_90a (QGMMA, UTMALDG, no spills) in CI;
**not yet run on a GPU**, so not wired into ``torch.ops.cute_moe.grouped_gemm_fp8``
until ``tests/test_gpu_grouped_gemm.py`` passes on the H200.  It is the correct-
first baseline of issue 3, not the fast kernel: one CTA per output tile (not
persistent), no multicast, a plain register epilogue.

Math (``reference.grouped_gemm_fp8_ref``): for every row ``r`` of expert ``e``'s
segment ``[off[e], off[e+1])`` and column ``n``::

    C[r, n] = sum_kb  a_scale[r, kb] * b_scale[e, n // 128, kb]
                      * sum_{k in block kb} A[r, k] * B[e, n, k]      (f32), bf16 out

Each 128-wide K block's FP8 product is accumulated by WGMMA into a temporary f32
accumulator, which is then promoted into the main f32 accumulator with the
block's two scales (promotion in f32, never in the tensor core's accumulator).

Mapping:
* CTA tile 128 x 128 (M x N), K tile 128 = one scale block; 384 threads: warp
  group 0 produces (its warp 0 issues the TMA loads of A and B tiles and copies
  the stage's 128 A scales and one B scale into shared memory), warp groups 1
  and 2 consume (64 rows each, ``QGMMA.64x128x32`` four times per K tile), with
  register reallocation (producer 40, consumers 232).
* Two mbarrier pipelines in lockstep over the same stages: a TMA pipeline for the
  A/B tiles (transaction-count barriers) and a thread pipeline for the scales
  (the producer warp's stores are released by its arrive), so the math warps
  read scales from shared memory only.
* Grid ``(ceil(N / 128), M_cap / 128)``: tile row ``m`` covers rows
  ``[128 m, 128 m + 128)``; segments are multiples of 128 rows (``align`` pads
  them), so the tile lies inside one expert's segment, found on the device by
  counting ``expert_offsets[1:] <= 128 m`` (a warp sum).  Tiles at or past
  ``expert_offsets[-1]`` exit at once.  Routing is never a compile-time constant.
* Epilogue: the f32 accumulator converted to bf16 and stored from registers,
  columns past N masked (N need not be a multiple of 128, e.g. 2112).

Constraints: K % 128 == 0; N % 8 == 0; M_cap % 128 == 0 and every segment
length a multiple of 128; A, B K-major with 16-byte aligned rows; a_scale
MN-major (strides (1, M_cap)).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor

TILE_M, TILE_N, TILE_K = 128, 128, 128
ROW_ALIGNMENT = TILE_M  # segment lengths the kernel needs (align's `alignment`)
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232
_STAGES = 5  # 5 x (16 KB A + 16 KB B + 516 B scales) = 163 KB of shared memory


class GroupedGemmFp8Sm90:
    """Static configuration: tile shape and pipeline depth (dtypes are fixed: e4m3 in, bf16 out)."""

    num_threads = 384
    num_consumer_warps = 8

    def __init__(self):
        self.stages = _STAGES
        self.dynamic_smem_bytes = self.stages * (TILE_M * TILE_K + TILE_N * TILE_K + 4 * TILE_M + 4)

    @staticmethod
    def can_implement(m_cap: int, n: int, k: int) -> str | None:
        if k % TILE_K or k == 0:
            return f"K must be a positive multiple of {TILE_K}, got {k}"
        if n % 8 or n == 0:
            return f"N must be a positive multiple of 8, got {n}"
        if m_cap % TILE_M:
            return f"M_cap must be a multiple of {TILE_M} (align with alignment={ROW_ALIGNMENT}), got {m_cap}"
        return None

    def _smem_layout(self, rows: int):
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, cutlass.Float8E4M3FN, TILE_K),
            cutlass.Float8E4M3FN,
        )
        return cute.tile_to_shape(atom, (rows, TILE_K, self.stages), order=(0, 1, 2))

    @cute.jit
    def __call__(self, mA, mB, mSA, mSB, mOff, mC, stream):
        fp8 = cutlass.Float8E4M3FN
        # Codes travel as uint8 through TVM-FFI; the kernel sees e4m3.
        mA = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=fp8), mA.layout)  # (M_cap, K)
        mB = cute.make_tensor(cute.recast_ptr(mB.iterator, dtype=fp8), mB.layout)  # (N, K, E)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (2, 1, 1), tiler_mn=(64, TILE_N),
        )  # fmt: skip
        sA_layout = self._smem_layout(TILE_M)
        sB_layout = self._smem_layout(TILE_N)
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sA_layout, (None, None, 0)), (TILE_M, TILE_K)
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(sB_layout, (None, None, 0)), (TILE_N, TILE_K)
        )

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            scale_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, self.stages * TILE_M], 16]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, self.stages], 16]
            sA: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[fp8, cute.cosize(sB_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, sA_layout, sB_layout, mSA, mSB, mOff, mC).launch(
            grid=[cute.ceil_div(mC.shape[1], TILE_N), mC.shape[0] // TILE_M, 1],
            block=[self.num_threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, tiled_mma, tma_a, mA, tma_b, mB, sA_layout, sB_layout, mSA, mSB, mOff, mC):
        tidx, _, _ = cute.arch.thread_idx()
        n_tile, m_tile, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        row0 = m_tile * TILE_M
        num_experts = mOff.shape[0] - 1

        if row0 < mOff[num_experts]:  # uniform over the CTA: tiles past the last segment exit
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            expert = self.expert_of_row(mOff, row0, num_experts, lane)
            k_tiles = mA.shape[1] // TILE_K

            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            tx_bytes = cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sA_layout, (None, None, 0))) + cute.size_in_bytes(
                cutlass.Float8E4M3FN, cute.slice_(sB_layout, (None, None, 0))
            )
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.ab_barriers.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_warps),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            )
            scale_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.scale_barriers.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.num_consumer_warps),
            )
            sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sSA = storage.sSA.get_tensor(cute.make_layout((TILE_M, self.stages)))
            sSB = storage.sSB.get_tensor(cute.make_layout((self.stages,)))

            warp_group = cute.arch.make_warp_uniform(tidx // 128)
            if warp_group == 0:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self.produce(tma_a, mA, tma_b, mB, sA, sB, sSA, sSB, mSA, mSB, ab_pipe, scale_pipe,
                                 row0, m_tile, n_tile, expert, k_tiles, lane)  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(_CONSUMER_REGS)
                self.consume(tiled_mma, sA, sB, sSA, sSB, ab_pipe, scale_pipe, mC, m_tile, n_tile, k_tiles, tidx - 128)

    @cute.jit
    def expert_of_row(self, mOff, row, num_experts, lane):
        """The expert whose segment holds ``row``: how many segment ends are <= row (a warp sum)."""
        count = Int32(0)
        for i in range(lane, num_experts, 32):
            if mOff[i + 1] <= row:
                count += 1
        return cute.arch.warp_reduction_sum(count)

    @cute.jit
    def produce(self, tma_a, mA, tma_b, mB, sA, sB, sSA, sSB, mSA, mSB, ab_pipe, scale_pipe,
                row0, m_tile, n_tile, expert, k_tiles, lane):  # fmt: skip
        """Warp 0: per K tile, TMA A and B into a stage, and copy the stage's scales."""
        gA = cute.local_tile(mA, (TILE_M, TILE_K), (None, None))  # (bM, bK, RestM, RestK)
        gB = cute.local_tile(mB, (TILE_N, TILE_K), (None, None, None))  # (bN, bK, RestN, RestK, E)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for k_tile in range(k_tiles):
            ab_pipe.producer_acquire(ab_state)
            barrier = ab_pipe.producer_get_barrier(ab_state)
            cute.copy(tma_a, tAgA[(None, m_tile, k_tile)], tAsA[(None, ab_state.index)], tma_bar_ptr=barrier)
            cute.copy(tma_b, tBgB[(None, n_tile, k_tile, expert)], tBsB[(None, ab_state.index)], tma_bar_ptr=barrier)
            ab_pipe.producer_commit(ab_state)
            ab_state.advance()

            # The 128 A scales of this K block are contiguous (MN-major): 4 per lane; lane 0
            # adds the B scale. The arrive of producer_commit releases these stores.
            scale_pipe.producer_acquire(scale_state)
            for j in cutlass.range_constexpr(TILE_M // 32):
                sSA[lane * (TILE_M // 32) + j, scale_state.index] = mSA[row0 + lane * (TILE_M // 32) + j, k_tile]
            if lane == 0:
                sSB[scale_state.index] = mSB[expert, n_tile, k_tile]
            scale_pipe.producer_commit(scale_state)
            scale_state.advance()
        ab_pipe.producer_tail(ab_state)

    @cute.jit
    def consume(self, tiled_mma, sA, sB, sSA, sSB, ab_pipe, scale_pipe, mC, m_tile, n_tile, k_tiles, consumer_tidx):
        """Warp groups 1-2: per K tile, 4 WGMMAs into a temporary accumulator, then promotion."""
        thr_mma = tiled_mma.get_slice(consumer_tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        gC = cute.local_tile(mC, (TILE_M, TILE_N), (m_tile, n_tile))
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        acc = cute.make_rmem_tensor(tCgC.shape, Float32)
        block_acc = cute.make_rmem_tensor(tCgC.shape, Float32)
        acc.fill(0.0)
        num_k_blocks = cute.size(tCrA, mode=[2])

        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for k_tile in range(k_tiles):
            ab_pipe.consumer_wait(ab_state)
            cute.nvgpu.warpgroup.fence()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, ab_state.index)
                cute.gemm(tiled_mma, block_acc, tCrA[coord], tCrB[coord], block_acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(ab_state)
            ab_state.advance()

            scale_pipe.consumer_wait(scale_state)
            b_scale = sSB[scale_state.index]
            for i in cutlass.range_constexpr(cute.size(acc)):
                row = tCcC[i][0]
                acc[i] = acc[i] + block_acc[i] * (sSA[row, scale_state.index] * b_scale)
            scale_pipe.consumer_release(scale_state)
            scale_state.advance()

        n_left = mC.shape[1] - n_tile * TILE_N
        for i in cutlass.range_constexpr(cute.size(acc)):
            if tCcC[i][1] < n_left:
                tCgC[i] = acc[i].to(cutlass.BFloat16)


@cached_compile
def compile_grouped_gemm_fp8(arch: str, keep_cubin: bool = False):
    """One binary for every M_cap, N, K, expert count and routing."""
    m_cap, n, k, e, k_blocks, n_blocks = (cute.sym_int() for _ in range(6))
    mA = fake_tensor(cutlass.Uint8, (m_cap, k), (cute.sym_int64(divisibility=16), 1))
    mB = fake_tensor(cutlass.Uint8, (n, k, e), (cute.sym_int64(divisibility=16), 1, cute.sym_int64(divisibility=16)))
    mSA = fake_tensor(Float32, (m_cap, k_blocks), (1, cute.sym_int64()), align=4)
    mSB = fake_tensor(Float32, (e, n_blocks, k_blocks), (cute.sym_int64(), cute.sym_int64(), 1), align=4)
    mOff = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    mC = fake_tensor(cutlass.BFloat16, (m_cap, n), (cute.sym_int64(divisibility=8), 1))
    return compile_kernel(GroupedGemmFp8Sm90(), mA, mB, mSA, mSB, mOff, mC, arch=arch, keep_cubin=keep_cubin)


def grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets):
    """Launch on a's device and current stream; inputs validated by the op layer."""
    m_cap, k = a.shape
    n = b.shape[1]
    reason = GroupedGemmFp8Sm90.can_implement(m_cap, n, k)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.grouped_gemm_fp8: no sm_90a kernel for this input: {reason}")
    if a_scale.stride(0) != 1:
        raise ValueError(
            f"cute_moe.grouped_gemm_fp8: a_scale must be MN-major (stride(0) == 1), got strides {tuple(a_scale.stride())}"
        )
    c = torch.empty((m_cap, n), dtype=torch.bfloat16, device=a.device)
    if m_cap == 0 or b.shape[0] == 0:  # no rows, or no experts (a zero-extent TMA box cannot be encoded)
        return c
    arch = arch_of_device(a.device)
    if arch != "sm_90a":
        raise NotImplementedError(f"cute_moe.grouped_gemm_fp8: this kernel is for sm_90a, the device is {arch}")
    fn = compile_grouped_gemm_fp8(arch)
    fn(a.view(torch.uint8), b.view(torch.uint8).permute(1, 2, 0), a_scale, b_scale, expert_offsets, c)
    return c


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes); the kernel exists for sm_90a only."""
    if arch != "sm_90a":
        return []
    return [("grouped_gemm_fp8[sm90, 128x128x128, 5 stages]", compile_grouped_gemm_fp8(arch, True),
             GroupedGemmFp8Sm90().dynamic_smem_bytes)]
