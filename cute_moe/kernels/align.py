"""Expert alignment (``cute_moe.align``) as a CuTe DSL kernel: the op's CUDA implementation,
checked on an H200 by tests/test_gpu_align.py (compiled for sm_90a and sm_100a).

Math (``reference.align_ref``, bit for bit): with ``n = T * k`` flattened
entries ``i = t * k + j`` and ``key(i) = topk_ids[i] - expert_offset`` when that
lies in ``[0, E_local)`` (else the entry is not local)::

    counts[e]        = #{i : key(i) == e}
    offsets[0]       = 0;  offsets[e + 1] = offsets[e] + round_up(counts[e], alignment)
    rank(i)          = #{i' < i : key(i') == key(i)}          (a stable counting sort)
    token_to_row[i]  = offsets[key(i)] + rank(i), or -1 when not local
    row_to_token[r]  = i // k for the row r of entry i; -1 for every other row < M_cap
                       (segment padding and every row past offsets[E_local])

Mapping: one CTA of 1024 threads (32 warps), one launch, no host synchronisation
and no grid that depends on the data (from ``n = MIN_CTAS * ENTRIES_PER_CTA``: the
two-launch variant below).  Warp ``w`` owns the contiguous slice
``[w * S, (w + 1) * S)`` of the flattened entries (``S = ceil(n / 1024) * 32``)
and walks it in batches of ``U`` sub-chunks of 32 entries (lane ``l`` takes
entry ``base + 32 u + l``: coalesced 128-byte loads, all ``U`` of a batch issued
before any of them is used; see ``batch_keys``), ``U = 16`` in the histogram
pass and 8 in the rank pass (50-52 registers of the 64 a 1024-thread CTA allows).
Shared memory holds a counter table ``cnt[32 warps][E_local + 1]`` (column
``E_local`` is a dump slot for non-local entries and for lanes past the slice),
so each warp has private counters:

1. Histogram: each entry adds 1 to ``cnt[w][key]`` with a shared-memory atomic
   (``ATOMS.POPC.INC``: the hardware aggregates equal addresses within the warp).
   Atomics are fine here: only the totals per (warp, expert) matter, not the order.
2. Scan (``__syncthreads`` before and after): thread ``e`` turns column ``e`` into
   ``counts[e]`` (sum over warps), the padded counts are scanned over the block
   (shuffle scan per warp, then over the 32 warp totals) into ``offsets``, and
   column ``e`` becomes ``base[w][e] = offsets[e] + sum_{w' < w} cnt[w'][e]``: the
   first row of expert ``e`` that warp ``w`` hands out.  ``expert_offsets`` and
   ``expert_counts`` are written here.
3. ``row_to_token = -1`` for the padding rows of each segment (warp ``w`` takes
   experts ``w, w + 32, ...``, lanes stride over the segment's ``< alignment``
   padding rows) and for rows ``[offsets[E_local], M_cap)`` (block-stride loop).
   These rows are disjoint from the rows pass 4 writes, so no ordering is needed,
   and every one of the ``M_cap`` rows is written by the kernel: the launch
   function allocates with ``torch.empty`` and never zero- or -1-fills on the host.
4. Ranks: the warp walks its slice again, in the same order (ascending ``i``);
   within a sub-chunk ``rank = base[w][key] + popc(peers & lanemask_lt)``, then
   the group's first lane advances ``base[w][key]`` by the group size (a
   ``__syncwarp`` before and after the update).  Because warp slices are in
   ascending order and ``base`` already counts the earlier warps' entries, the
   result is the stable order of the reference with no inter-warp communication.
   Each local entry writes ``token_to_row[i]`` and ``row_to_token[row]``; a
   non-local entry writes ``token_to_row[i] = -1``.

Cost: ``topk_ids`` is read twice (the second time mostly from L2; three times in the
two-launch variant), ``token_to_row``
and ``expert_offsets``/``expert_counts`` written once, ``row_to_token`` written
once per row.  In one CTA all of it goes through one SM, so the time grows with
``n``: about 1.3 ns per entry on an H200 (it would be 85 µs for DeepSeek-V3 at T = 8192,
65536 entries, which therefore takes the two-launch variant below: 11.5 µs measured).

Two-launch variant (``align_ctas``: ``C = min(MAX_CTAS, n // ENTRIES_PER_CTA)``
CTAs when that is at least ``MIN_CTAS``): CTA ``b`` takes the chunk
``[1024 b S, 1024 (b + 1) S)`` with ``S = ceil(n / (1024 C))``, in 32 warp slices of
``32 S`` entries (so ``ENTRIES_PER_CTA = 1024`` is the smallest chunk, and trailing chunks
may be empty: then ``n < 1024 C S``).  Launch 1
(``step="histogram"``) runs pass 1 and writes each CTA's per-expert totals to
``hist[C, E_local]``.  Launch 2 (``step="rank"``) runs pass 1 again (its counts are
still needed per warp), then thread ``e`` sums column ``e`` of ``hist`` (the
counts) and its part above this CTA's row (the rows the earlier chunks take, added
to the bases), and passes 2-4 follow; only CTA 0 writes ``expert_offsets`` and
``expert_counts``, and pass 3 is shared out over every warp of the launch.  The
result is the same stable order, bit for bit.

Constraints (``AlignKernel.can_implement`` and ``align_cuda``):
``1 <= E_local <= 1024`` (thread ``e`` owns expert ``e`` in the scan; the counter
table is ``32 * (E_local + 1) * 4`` bytes of shared memory, 128 KB at 1024);
``n = T * k <= MAX_ENTRIES`` (2**22) and ``M_cap < 2**31 - 32768`` (int32 rows: pass 3
strides them by up to ``MAX_CTAS * 1024``).
``k``, ``E_local``, ``alignment`` and ``expert_offset`` are compiled in (one
variant per EP rank); ``T`` and ``M_cap`` are dynamic.  ``T = 0`` launches
nothing.  ``topk_ids`` must be int32 (a non-contiguous one is copied first);
ids outside ``[0, num_experts)`` are outside the op's contract and are treated
as not local.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor
from ..reference import m_cap
from .reduce_common import opaque_zero

NUM_WARPS = 32
NUM_THREADS = 32 * NUM_WARPS
MAX_LOCAL_EXPERTS = NUM_THREADS  # thread e owns expert e in the scan
MAX_ENTRIES = 1 << 22
MAX_CTAS = 32  # the two-launch variant: CTAs per launch (each reads every CTA's counts)
ENTRIES_PER_CTA = 1024  # ... and this many entries per CTA (a warp slice of 32, the smallest)
MIN_CTAS = 4  # below this many, one launch of one CTA is as quick
STEPS = ("all", "histogram", "rank")  # AlignKernel's step: one launch, or the two-launch variant's two
SUBCHUNKS = 8  # rank pass: 32-entry sub-chunks per batch (loads per lane in flight)
HIST_SUBCHUNKS = 16  # histogram pass: its loop body is short, so more loads in flight


# ----------------------------------------------------------------------------- device


@dsl_user_op
def match_any(value, *, loc=None, ip=None) -> Int32:
    """``match.any.sync.b32`` over the full warp: the mask of the lanes holding ``value``.

    Marked as having side effects so that LLVM neither sinks it into a branch nor
    merges it: every lane of the warp must execute it together.
    """
    ops = [Int32(value).ir_value(loc=loc, ip=ip)]
    res = llvm.inline_asm(
        Int32.mlir_type, ops, "match.any.sync.b32 $0, $1, -1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return Int32(res)


@dsl_user_op
def lanemask_lt(*, loc=None, ip=None) -> Int32:
    """The mask of the lanes below this one (``%lanemask_lt``)."""
    res = llvm.inline_asm(
        Int32.mlir_type, [], "mov.u32 $0, %lanemask_lt;", "=r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip
    return Int32(res)


class AlignKernel:
    """Static configuration: top-k, local expert count and offset, segment alignment."""

    def __init__(self, k: int, num_local_experts: int, alignment: int, expert_offset: int, step: str = "all"):
        self.k = k
        self.num_local = num_local_experts
        self.alignment = alignment
        self.expert_offset = expert_offset
        # "all": one CTA does every pass.  The two-launch variant splits the entries into one
        # contiguous chunk per CTA: "histogram" writes each CTA's per-expert counts to mHist [CTAs, E],
        # "rank" reads them all (counts, offsets, and the rows the earlier CTAs take) and does
        # passes 2-4 for its chunk.
        assert step in STEPS, step
        self.step = step

    def smem_bytes(self) -> int:
        """Counter table, offsets, counts and warp totals (int32)."""
        return 4 * (NUM_WARPS * (self.num_local + 1) + (self.num_local + 1) + self.num_local + NUM_WARPS) + 64

    @staticmethod
    def can_implement(k: int, num_local_experts: int, alignment: int, num_tokens: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if not 1 <= num_local_experts <= MAX_LOCAL_EXPERTS:
            return f"num_local_experts must be in [1, {MAX_LOCAL_EXPERTS}], got {num_local_experts}"
        if k < 1:
            return f"top_k must be >= 1, got {k}"
        if alignment < 1:
            return f"alignment must be >= 1, got {alignment}"
        if num_tokens * k > MAX_ENTRIES:
            return f"T * k must be <= {MAX_ENTRIES}, got {num_tokens * k}"
        if m_cap(num_tokens, k, num_local_experts, alignment) >= (1 << 31) - MAX_CTAS * NUM_THREADS:
            return f"M_cap must be below 2**31 - {MAX_CTAS * NUM_THREADS} (int32 row indices)"
        return None

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mOff: cute.Tensor, mR2T: cute.Tensor, mT2R: cute.Tensor,
                 mCnt: cute.Tensor, mHist: cute.Tensor, ctas: Int32, stream):  # fmt: skip
        if cutlass.const_expr(self.step == "all"):
            ctas = Int32(1)  # its passes assume they see every entry
        self.kernel(mIds, mOff, mR2T, mT2R, mCnt, mHist).launch(
            grid=[ctas, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream
        )

    @cute.jit
    def batch_keys(self, mIds: cute.Tensor, base, lane, stop, zero: Int32, count: cutlass.Constexpr):
        """The local experts of entries ``base + 32 u + lane`` (``u < count``); ``num_local``
        (the dump column) for an entry that is not local or at or past ``stop``.

        The loads are unconditional (clamped to ``stop - 1``, an entry of this slice) and all
        issued before any key is used: the first key is made to depend on every loaded value
        (``| (OR of them & zero)``, ``zero`` being ``opaque_zero``), otherwise ptxas issues
        the last loads of the batch only after the first ``MATCH`` has waited for its data.
        """
        vals = [mIds[cutlass.min(base + u * 32 + lane, stop - 1)] for u in range(count)]
        tie = vals[0]
        for u in cutlass.range_constexpr(1, count):
            tie = tie | vals[u]
        vals[0] = vals[0] | (tie & zero)
        keys = []
        for u in cutlass.range_constexpr(count):
            v = vals[u] - self.expert_offset
            key = Int32(self.num_local)
            if (base + u * 32 + lane < stop) & (v >= 0) & (v < self.num_local):
                key = v
            keys.append(key)
        return keys

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mOff: cute.Tensor, mR2T: cute.Tensor, mT2R: cute.Tensor, mCnt: cute.Tensor,
               mHist: cute.Tensor):  # fmt: skip
        E = self.num_local
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        warp = cute.arch.make_warp_uniform(warp)
        lane = cute.arch.lane_idx()
        below = lanemask_lt()
        n = mIds.shape[0]
        zero = opaque_zero(n)

        smem = cutlass.memory.SmemAllocator()
        sCnt = smem.allocate_tensor(Int32, cute.make_layout((NUM_WARPS, E + 1), stride=(E + 1, 1)), byte_alignment=16)
        sOff = smem.allocate_tensor(Int32, cute.make_layout(E + 1), byte_alignment=16)
        sNum = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(NUM_WARPS), byte_alignment=16)

        for i in range(tidx, NUM_WARPS * (E + 1), NUM_THREADS):
            sCnt[i // (E + 1), i % (E + 1)] = Int32(0)
        cute.arch.sync_threads()

        # This warp's slice of the CTA's chunk of the flattened entries (a multiple of 32 long:
        # aligned loads; the chunks, and the slices in them, in ascending order).
        per_warp = cute.ceil_div(n, ctas * NUM_THREADS) * 32
        start = (bid * NUM_WARPS + warp) * per_warp
        stop = cutlass.min(start + per_warp, n)

        # 1. Per-warp histogram.
        for base in range(start, stop, 32 * HIST_SUBCHUNKS):
            keys = self.batch_keys(mIds, base, lane, stop, zero, HIST_SUBCHUNKS)
            for u in cutlass.range_constexpr(HIST_SUBCHUNKS):
                cute.arch.atomic_add(sCnt.iterator + (warp * (E + 1) + keys[u]), Int32(1), scope="cta")
        cute.arch.sync_threads()
        if cutlass.const_expr(self.step == "histogram"):
            if tidx < E:
                chunk_count = Int32(0)
                for w in cutlass.range_constexpr(NUM_WARPS):
                    chunk_count = chunk_count + sCnt[w, tidx]
                mHist[bid, tidx] = chunk_count
        else:
            self.offsets_and_ranks(mIds, mOff, mR2T, mT2R, mCnt, mHist, sCnt, sOff, sNum, sWarp, bid, ctas, tidx,
                                   warp, lane, below, start, stop, zero)  # fmt: skip

    @cute.jit
    def offsets_and_ranks(self, mIds, mOff, mR2T, mT2R, mCnt, mHist, sCnt, sOff, sNum, sWarp, bid, ctas, tidx, warp,
                          lane, below, start, stop, zero):  # fmt: skip
        """Passes 2-4 (the per-warp counts of pass 1 are in ``sCnt``)."""
        E = self.num_local
        m_rows = mR2T.shape[0]
        # 2. Counts, padded offsets (block scan), per-warp bases.  In the rank step, thread e also
        # sums the counts of expert e that the earlier chunks hold (``before``): its rows come first.
        count = Int32(0)
        before = Int32(0)
        if tidx < E:
            if cutlass.const_expr(self.step == "rank"):
                for c in cutlass.range_constexpr(MAX_CTAS):  # independent loads, all in flight together
                    h = Int32(0)
                    if c < ctas:
                        h = mHist[c, tidx]
                    count = count + h
                    if c < bid:
                        before = before + h
            else:
                for w in cutlass.range_constexpr(NUM_WARPS):
                    count = count + sCnt[w, tidx]
        padded = (count + (self.alignment - 1)) // self.alignment * self.alignment
        incl = padded
        for d in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << d)
            if lane >= (1 << d):
                incl = incl + up
        if lane == 31:
            sWarp[warp] = incl
        cute.arch.sync_threads()
        if warp == 0:
            total = sWarp[lane]
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(total, 1 << d)
                if lane >= (1 << d):
                    total = total + up
            sWarp[lane] = total
        cute.arch.sync_threads()
        excl = incl - padded
        if warp > 0:
            excl = excl + sWarp[warp - 1]
        if tidx < E:
            if bid == 0:
                mOff[tidx] = excl
                mCnt[tidx] = count
            sOff[tidx] = excl
            sNum[tidx] = count
            run = excl + before
            for w in cutlass.range_constexpr(NUM_WARPS):
                c = sCnt[w, tidx]
                sCnt[w, tidx] = run
                run = run + c
        if tidx == 0:
            end = sWarp[NUM_WARPS - 1]
            if bid == 0:
                mOff[E] = end
            sOff[E] = end
        cute.arch.sync_threads()

        # 3. -1 in every row no entry takes: segment padding, then rows past the last segment
        # (shared out over every warp of the launch).
        for e in range(bid * NUM_WARPS + warp, E, ctas * NUM_WARPS):
            for r in range(sOff[e] + sNum[e] + lane, sOff[e + 1], 32):
                mR2T[r] = Int32(-1)
        for r in range(sOff[E] + bid * NUM_THREADS + tidx, m_rows, ctas * NUM_THREADS):
            mR2T[r] = Int32(-1)

        # 4. Stable ranks, in ascending entry order within the warp's slice.
        for base in range(start, stop, 32 * SUBCHUNKS):
            keys = self.batch_keys(mIds, base, lane, stop, zero, SUBCHUNKS)
            for u in cutlass.range_constexpr(SUBCHUNKS):
                idx = base + u * 32 + lane
                key = keys[u]
                peers = match_any(key)
                first = peers & below
                row = sCnt[warp, key] + cute.arch.popc(first)
                cute.arch.sync_warp()
                if first == 0:
                    sCnt[warp, key] = row + cute.arch.popc(peers)
                cute.arch.sync_warp()
                t2r = row
                if key == E:  # not local, or past the slice
                    t2r = Int32(-1)
                if idx < stop:
                    mT2R[idx] = t2r
                if key < E:  # implies idx < stop
                    mR2T[row] = Int32(Uint32(idx) // self.k)  # idx >= 0: unsigned division is cheaper


@cached_compile
def compile_align(k: int, num_local_experts: int, alignment: int, expert_offset: int, arch: str,
                  keep_cubin: bool = False, step: str = "all"):  # fmt: skip
    """Compile for every T, M_cap and CTA count; the key is the scalars above."""
    mIds = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    mOff = fake_tensor(Int32, (num_local_experts + 1,), (1,), align=4)
    mR2T = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    mT2R = fake_tensor(Int32, (cute.sym_int(),), (1,), align=4)
    mCnt = fake_tensor(Int32, (num_local_experts,), (1,), align=4)
    mHist = fake_tensor(Int32, (cute.sym_int(), num_local_experts), (num_local_experts, 1), align=4)
    kernel = AlignKernel(k, num_local_experts, alignment, expert_offset, step)
    return compile_kernel(kernel, mIds, mOff, mR2T, mT2R, mCnt, mHist, Int32(1), arch=arch, keep_cubin=keep_cubin)


@cached_compile
def compile_align_steps(k: int, num_local_experts: int, alignment: int, expert_offset: int, arch: str):
    """(single launch, two-launch histogram step, two-launch rank step), compiled together: which
    runs depends on T (``align_ctas``), and a CUDA graph captured at a T the eager warm-up did not
    reach must not need a compile."""
    return tuple(compile_align(k, num_local_experts, alignment, expert_offset, arch, False, step) for step in STEPS)


def align_ctas(num_entries: int) -> int:
    """CTAs for ``num_entries = T * k``: the two-launch variant with ``ENTRIES_PER_CTA`` entries per
    CTA (at most ``MAX_CTAS`` CTAs) when that makes ``MIN_CTAS`` or more, else one CTA.  H200,
    E=256, k=8, µs per call (bench/NOTES.md, session 10): one CTA 9.1 / 12.8 / 16.7 / 46.2 / 84.6
    / 161.4 at T = 128 / 512 / 1024 / 4096 / 8192 / 16384; two launches 9.5-9.9 at T = 512-2048
    with 4-16 CTAs, 13.3-13.8 at T = 4096-16384 with 32."""
    ctas = min(MAX_CTAS, num_entries // ENTRIES_PER_CTA)
    return ctas if ctas >= MIN_CTAS else 1


def align_cuda(topk_ids: torch.Tensor, num_experts: int, alignment: int = 128, expert_offset: int = 0,
               num_local_experts: int | None = None, ctas: int | None = None):  # fmt: skip
    """Launch on topk_ids' device and current stream; inputs already validated by the op layer.

    Returns (expert_offsets [E_local+1], row_to_token [M_cap], token_to_row [T, k], expert_counts
    [E_local]), all int32.  ``num_experts`` only bounds the ids (checked by the op layer).
    ``ctas`` (tests, benchmarks): the CTA count, 1 to ``MAX_CTAS``, instead of ``align_ctas``.
    """
    T, k = topk_ids.shape
    if ctas is not None and not 1 <= ctas <= MAX_CTAS:
        raise ValueError(f"cute_moe.align: ctas must be in [1, {MAX_CTAS}], got {ctas}")
    E_local = num_experts if num_local_experts is None else num_local_experts
    dev = topk_ids.device
    rows = m_cap(T, k, E_local, alignment)
    if T == 0 or k == 0:
        return (
            torch.zeros(E_local + 1, dtype=torch.int32, device=dev),
            torch.full((rows,), -1, dtype=torch.int32, device=dev),
            torch.empty(T, k, dtype=torch.int32, device=dev),
            torch.zeros(E_local, dtype=torch.int32, device=dev),
        )
    reason = AlignKernel.can_implement(k, E_local, alignment, T)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.align: no CUDA kernel for this input: {reason}")
    if topk_ids.dtype != torch.int32:
        raise NotImplementedError(f"cute_moe.align: the CUDA kernel takes int32 topk_ids, got {topk_ids.dtype}")
    ids = topk_ids.contiguous().view(-1)
    offsets = torch.empty(E_local + 1, dtype=torch.int32, device=dev)
    row_to_token = torch.empty(rows, dtype=torch.int32, device=dev)  # every row written by the kernel
    token_to_row = torch.empty(T, k, dtype=torch.int32, device=dev)
    counts = torch.empty(E_local, dtype=torch.int32, device=dev)
    ctas = align_ctas(ids.numel()) if ctas is None else ctas
    single, histogram, rank = compile_align_steps(k, E_local, alignment, expert_offset, arch_of_device(dev))
    outputs = (offsets, row_to_token, token_to_row.view(-1), counts)
    if ctas == 1:
        single(ids, *outputs, counts.view(1, -1), 1)  # (no hist: the counts stand in, never read)
    else:
        hist = torch.empty(ctas, E_local, dtype=torch.int32, device=dev)  # every entry written by step 1
        histogram(ids, *outputs, hist, ctas)
        rank(ids, *outputs, hist, ctas)
    return offsets, row_to_token, token_to_row, counts


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect align``."""
    return [
        (
            f"align[k={k}, E_local={e}, alignment={a}, expert_offset={off}"
            f"{'' if step == 'all' else ', two launches: ' + step}]",
            compile_align(k, e, a, off, arch, True, step),
            AlignKernel(k, e, a, off, step).smem_bytes(),
        )
        for k, e, a, off in [(8, 256, 128, 0), (1, 8, 1, 0), (6, 64, 16, 32), (2, 1024, 128, 0)]
        for step in STEPS
    ]
