"""Gather rows into expert order (``cute_moe.permute_quant`` and ``cute_moe.permute``)
as CuTe DSL kernels.

Math, per output row ``r < end = expert_offsets[-1]`` (read on the device) with
``t = row_to_token[r]``:

* ``permute_quant``: ``a[r], a_scale[r] = quant(x[t])`` per group of 128 columns
  with the contract's formula (``fp8_group.quantize_group_fp8``); a padding row
  (``t == -1``) is quantized from zeros, i.e. codes 0 and the scale of an
  all-zero group (``1e-6 / 448``, or its ue8m0 rounding ``2**-28``), exactly what
  ``reference.permute_quant_ref`` writes.
* ``permute``: ``a[r] = a_in[t]``, ``a_scale[r] = a_in_scale[t]``; a padding row
  gets codes 0 and scale 1.0 (``reference.permute_ref``).

Rows ``r >= end`` are neither read nor written.  A token id outside ``[0, T)``
other than -1 is outside the op's contract; the kernels treat it as padding
rather than read out of bounds.  Scales are written MN-major (``a_scale[r, g]``
at ``g * M_cap + r``).

Row-major mapping (``PermuteQuantKernel``, ``PermuteKernel``): one (row, group
of 128 columns) is handled by ``L`` consecutive lanes, each owning 16 bytes of
input (bf16/fp16: ``L = 16`` lanes of 8 elements; fp8: ``L = 8`` lanes of 16
codes), as in ``quant_fp8``.  A CTA of 256 threads covers ``256 / L`` groups of
lanes, each doing 4 consecutive output rows of one group column: 64 (bf16) or
128 (fp8) rows per CTA; the grid is ``(H / 128, ceil(M_cap / rows_per_cta))``
with group columns fastest, so neighbouring CTAs read neighbouring bytes of the
same source rows.  A CTA first stages its rows' token ids in shared memory (one
coalesced load, a barrier), so that every row load's address is ready at once:

* ``permute_quant`` issues its 4 row loads per thread (64 bytes) as ``cp.async``
  into per-thread shared-memory slots, waits once, then quantizes each row from
  its slot (amax: shuffle reduction over the ``L`` lanes).  With plain loads
  ptxas interleaves the dependent gathers with the quantizer math (measured in
  the SASS: one or two loads in flight); ``cp.async`` keeps all four in flight
  and the data out of registers (32-36 registers).
* ``permute`` has no math between its loads: 4 codes loads (16 bytes each) and 4
  scale loads per thread are all issued before the first store.

Padding rows are never loaded.  CTAs whose rows all lie at or past ``end`` exit
at once, so the work follows the routed rows, not ``M_cap``; row blocks beyond
the 65535 grid rows are covered by a grid-stride loop.  A token routed to ``k``
experts is read ``k`` times (once per output row).

Token-major mapping (``TokenPermuteQuantKernel``, ``permute_quant`` given
``token_to_row [T, k]``, the inverse map ``align`` returns: ``token_to_row[t, j]
= r`` exactly when ``row_to_token[r] = t``; -1 = expert not local): each token
row of x is read once and quantized once, and its codes and scales are stored to
each of its ``k`` rows.  One launch of a 1-D grid of two kinds of CTAs (and from
``TOKEN_SCALES_MIN_TOKENS`` tokens on a second, ``ScaleScatterKernel``, for the scales):

* gathering CTAs, ``ceil(H / 2048) * T`` of them, column slabs fastest: each
  takes one slab of 16 group columns (2048 columns) of one token, 16 lanes per
  (token, group) as in quant_fp8.  Each thread issues its 16-byte x load and its
  token_to_row entries (lane ``l`` loads entry
  ``l``, and ``l + 16`` when k > 16) before any math; quantizes; writes its 8 codes
  to the CTA's shared-memory copy of the slab (2 KB per token) and the group's
  scale to the rows of its entries (from ``TOKEN_SCALES_MIN_TOKENS`` tokens on:
  once, to the token's row of a ``[T, H / 128 rounded up to 8]`` scratch, which
  a second launch, ``ScaleScatterKernel``, moves to the rows with coalesced
  stores; the ``k`` scattered 4-byte stores per token and group cost 30% at
  T=16384).  After a proxy fence and one barrier, thread ``j < k`` copies each
  token's slab to destination ``j`` with one bulk copy
  (``cp.async.bulk`` shared -> global, up to 2 KB contiguous, no tensor map), and waits
  for the copies to have read shared memory before the CTA exits.  A destination
  is written when its row lies in ``[0, end)`` (-1 is skipped).  The bulk copies
  replace the 256 8-byte register stores per (token, slab, destination) of the
  earlier version: 7% faster at T=16384, the stream being write-bound.
* zeroing CTAs, ``ceil(H / 1024) * ceil(M_cap / 256)``: rows ``[256 b, 256 b +
  256)`` of a slab of 8 group columns.  Each thread reads one ``row_to_token``
  entry; each warp ballots its 32 padding rows (``t == -1`` or outside ``[0, T)``,
  row ``< end``) and writes them one by one: 1024 zero codes (two 16-byte stores
  per lane) and 8 scales of an all-zero group (taken from the quantizer itself; in the
  two-launch mode ``ScaleScatterKernel`` writes those scales instead, with coalesced stores).
  Blocks at or past ``end`` exit at once; only padding rows are written.  Not
  launched with ``zero_padding=False`` (``fused_moe``: its GEMMs and
  ``silu_mul_quant`` are given align's counts and never use a padding row).  At
  decode the zeroing is most of the kernel: ~1000 padding rows at T=1, from the 28
  CTAs that M_cap = 1024 gives it.

The two kinds write disjoint rows when the maps are each other's inverse (rows
named by neither stay unwritten).  Bytes: x read once, every row ``< end``
written once (routed rows' codes and scales, padding rows' zeros), plus
``row_to_token`` read once per slab and ``token_to_row`` by every thread of a
gathering CTA (from L1); in two launches also the ``[T, H / 128 rounded up to 8]``
f32 scratch written and read once and ``row_to_token`` read again.

Constraints (``can_implement``): x bf16/fp16 (``permute_quant``), a_in
float8_e4m3fn (``permute``); H a multiple of 128; unit column stride with a
16-byte aligned base and row stride (checked on the host); ``a_in_scale`` f32
with any strides.  Token-major: ``1 <= k <= 32`` (other k use the row-major
kernel), outputs allocated by the launch function (scales of row stride 1).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from ..validation import INT32_MAX
from .fp8_group import lanes_per_group, quantize_group_fp8
from .moe_rows import GROUP, RowGroupKernel, checked_outputs, load_16b_async, rows_end
from .reduce_common import opaque_zero

QUANT_DTYPES = (torch.bfloat16, torch.float16)
# From this many tokens on, the token-major permute_quant writes its scales in two launches
# (token-major, then ScaleScatterKernel); below, the k scattered stores per token cost less than
# a second launch.
TOKEN_SCALES_MIN_TOKENS = 2048


class _RowGather(RowGroupKernel):
    """Token staging shared by both gathers: each thread does 4 consecutive rows."""

    @cute.jit
    def stage_tokens(self, mR2T: cute.Tensor, sTok: cute.Tensor, first_cta_row, end, num_tokens, tidx):
        """The CTA's row_to_token slice into shared memory, one coalesced load; -1 marks padding,
        rows at or past ``end`` and ids outside [0, T)."""
        if tidx < self.rows_per_cta:
            row = first_cta_row + tidx
            tok = mR2T[cutlass.min(row, end - 1)]  # the loop runs only while end >= 1
            if row >= end or tok >= num_tokens:
                tok = Int32(-1)
            sTok[tidx] = tok
        cute.arch.sync_threads()

    @cute.jit
    def row_tokens(self, sTok: cute.Tensor, tidx):
        """(token, valid) for each of this thread's 4 consecutive rows (one 16-byte shared load)."""
        toks, valids = [], []
        for u in cutlass.range_constexpr(self.rows_per_thread):
            tok = sTok[(tidx // self.lanes) * self.rows_per_thread + u]
            toks.append(tok)
            valids.append(tok >= 0)
        cute.arch.sync_threads()  # sTok is rewritten by the next grid-stride iteration
        return toks, valids

    def alloc_tokens(self, smem):
        return smem.allocate_tensor(Int32, cute.make_layout(self.rows_per_cta), byte_alignment=16)

    def smem_bytes(self) -> int:
        return 4 * self.rows_per_cta


class PermuteQuantKernel(_RowGather):
    """Static configuration: input dtype and scale format."""

    def __init__(self, dtype, ue8m0: bool):
        super().__init__(dtype.width // 8)
        self.dtype = dtype
        self.ue8m0 = ue8m0

    def smem_bytes(self) -> int:
        return super().smem_bytes() + 16 * self.num_threads * self.rows_per_thread

    @staticmethod
    def can_implement(dtype: torch.dtype, hidden: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if dtype not in QUANT_DTYPES:
            return f"x dtype must be one of {QUANT_DTYPES}, got {dtype}"
        if hidden % GROUP:
            return f"H must be a multiple of {GROUP}, got {hidden}"
        return None

    @cute.jit
    def __call__(self, mX, mR2T, mOff, mQ, mS, stream):
        mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Float8E4M3FN), mQ.layout)
        self.kernel(mX, mR2T, mOff, mQ, mS).launch(grid=self.grid(mQ), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR2T: cute.Tensor, mOff: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, group, bidy, grid_y, end, chunk = self.coords(mOff, mQ)
        # cp.async into per-thread slots of shared memory: the 4 row loads are issued back to back
        # and none of the math can be scheduled between them (it all waits on the group).
        g2s = load_16b_async(self.dtype)
        smem = cutlass.memory.SmemAllocator()
        sTok = self.alloc_tokens(smem)
        sX = smem.allocate_tensor(self.dtype, self.thread_slots(self.rows_per_thread), byte_alignment=16)
        # Row blocks at or past end do no iteration: the CTA exits.
        for block in range(bidy, cute.ceil_div(end, self.rows_per_cta), grid_y):
            first_row = block * self.rows_per_cta + (tidx // self.lanes) * self.rows_per_thread
            self.stage_tokens(mR2T, sTok, block * self.rows_per_cta, end, mX.shape[0], tidx)
            toks, valids = self.row_tokens(sTok, tidx)
            for u in cutlass.range_constexpr(self.rows_per_thread):
                if valids[u]:
                    src = cute.local_tile(mX[toks[u], None], (self.elems_per_lane,), (chunk,))
                    cute.copy(g2s, src, sX[None, tidx, u])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            for u in cutlass.range_constexpr(self.rows_per_thread):
                rX = cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
                cute.autovec_copy(sX[None, tidx, u], rX)
                if not valids[u]:  # padding: zeros (every lane joins the quantizer's shuffles)
                    rX.fill(0.0)
                self.quantize_store(rX, mQ, mS, first_row + u, end, group, chunk, tidx, self.ue8m0)


@dsl_user_op
def store_if(pred, addr, word, *, loc=None, ip=None) -> None:
    """``st.global.b32`` of ``word`` at the 64-bit global address ``addr`` when ``pred``: one
    predicated instruction, no branch (a ``cute.copy`` under ``if`` becomes a branch region)."""
    text = "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $1, 0;\n\t@p st.global.b32 [$0], $2;\n\t}"
    ops = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(v).ir_value(loc=loc, ip=ip) for v in (pred, word)]
    llvm.inline_asm(
        None, ops, text, "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def bulk_store(dst_addr, src: cute.Pointer, nbytes, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` of ``nbytes`` (a multiple of 16) from shared memory at ``src`` to the global
    address ``dst_addr`` (both 16-byte aligned), in the thread's current bulk group."""
    ops = [
        Int64(dst_addr).ir_value(loc=loc, ip=ip),
        src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
        Int32(nbytes).ir_value(loc=loc, ip=ip),
    ]
    llvm.inline_asm(
        None, ops, "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


@cute.jit
def zero_group_scale(ue8m0: cutlass.Constexpr) -> Float32:
    """The scale of an all-zero group, from the quantizer itself (1e-6 / 448, or 2**-28)."""
    rZ = cute.make_rmem_tensor((1,), Float32)
    rZ.fill(0.0)
    rQ = cute.make_rmem_tensor((1,), cutlass.Float8E4M3FN)
    return quantize_group_fp8(rZ, rQ, 1, ue8m0)


class TokenPermuteQuantKernel:
    """Token-major ``permute_quant``; static configuration: input dtype, scale format, top-k ``k``,
    and whether the zeroing CTAs run (``zero_padding=False`` launches the gathering CTAs only)."""

    num_threads = 256
    pad_groups = 8  # group columns per zeroing CTA: 1024 codes per row, two 16-byte stores per lane
    max_k = 32

    def __init__(self, dtype, ue8m0: bool, k: int, zero_padding: bool = True, token_scales: bool = False):
        self.dtype = dtype
        self.ue8m0 = ue8m0
        self.k = k
        self.zero_padding_ctas = zero_padding
        # token_scales: a token's scales go once to its row of the token_scale scratch, and
        # ScaleScatterKernel moves them to the k rows; else to each of the k rows from here.
        self.token_scales = token_scales
        self.lanes = lanes_per_group(dtype.width // 8, GROUP)
        self.elems_per_lane = GROUP // self.lanes
        self.slab_groups = self.num_threads // self.lanes  # group columns per gathering CTA
        self.entries_per_lane = -(-k // self.lanes)  # lane l holds destinations l, l + lanes, ...

    def smem_bytes(self) -> int:
        """The gathering CTA's codes: one 2 KB slab of its token."""
        return self.slab_groups * GROUP

    @classmethod
    def can_implement(cls, dtype: torch.dtype, hidden: int, k: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        reason = PermuteQuantKernel.can_implement(dtype, hidden)
        if reason is None and not 1 <= k <= cls.max_k:
            reason = f"top-k (token_to_row.shape[1]) must be in [1, {cls.max_k}], got {k}"
        return reason

    @cute.jit
    def ctas(self, num_tokens, hidden, m_cap):
        """(gathering CTAs: column slabs x tokens, zeroing CTAs: column slabs x row blocks)."""
        groups = hidden // GROUP
        zero = 0
        if cutlass.const_expr(self.zero_padding_ctas):
            zero = cute.ceil_div(groups, self.pad_groups) * cute.ceil_div(m_cap, self.num_threads)
        return cute.ceil_div(groups, self.slab_groups) * num_tokens, zero

    @cute.jit
    def __call__(self, mX, mT2R, mR2T, mOff, mQ, mS, mTS, stream):
        """``mTS``: the token-major scales with ``token_scales``, else not read."""
        mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Float8E4M3FN), mQ.layout)
        gather, zero = self.ctas(mX.shape[0], mQ.shape[1], mQ.shape[0])
        self.kernel(mX, mT2R, mR2T, mOff, mQ, mS, mTS).launch(
            grid=[gather + zero, 1, 1], block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX, mT2R, mR2T, mOff, mQ, mS, mTS):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        gather, _ = self.ctas(mX.shape[0], mQ.shape[1], mQ.shape[0])
        end = rows_end(mOff, mQ.shape[0])
        if bid < gather:
            self.gather(mX, mT2R, mQ, mS, mTS, bid, end, tidx)
        elif cutlass.const_expr(self.zero_padding_ctas):
            self.zero_padding(mR2T, mQ, mS, bid - gather, end, mX.shape[0], tidx)

    @cute.jit
    def gather(self, mX, mT2R, mQ, mS, mTS, bid, end, tidx):
        """Quantize one slab of 16 group columns of one token into shared memory, then copy the slab
        to the token's k rows with bulk copies (one per destination row).  One token per CTA: more
        measured alike at T=16384 (memory-bound) and slower at T=1 (bench/NOTES.md)."""
        groups = mQ.shape[1] // GROUP
        slabs = cute.ceil_div(groups, self.slab_groups)
        slab = bid % slabs
        tok = bid // slabs
        lane = tidx % self.lanes
        # Threads of a slab's missing groups (H not a multiple of 2048) quantize the last group again
        # and store nothing: every lane takes part in the quantizer's shuffles.
        group = slab * self.slab_groups + tidx // self.lanes
        active = group < groups
        chunk = cutlass.min(group, groups - 1) * self.lanes + lane
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        sQ = cutlass.memory.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout(self.smem_bytes() // 4), byte_alignment=128
        )
        # Every load first (lanes past k re-read entry k-1): lane l holds entries l, l + 16, ... of
        # the token; thread j < k also issues destination j's copy.
        rX = cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
        cute.copy(load, cute.local_tile(mX[tok, None], (self.elems_per_lane,), (chunk,)), rX)
        entries = [mT2R[tok, cutlass.min(lane + m * self.lanes, self.k - 1)] for m in range(self.entries_per_lane)]
        # The row's data OR-ed with (every loaded word & an opaque zero): bit for bit unchanged, but
        # no math starts before every load is issued (ptxas would otherwise sink the token_to_row
        # loads below the quantization to save registers).
        words = cute.recast_tensor(rX, Int32)
        tie = words[0]
        for entry in entries:
            tie = tie | entry
        words[0] = words[0] | (tie & opaque_zero(mX.shape[0]))
        s_base = (mS.iterator + group * mS.stride[1]).toint()
        rQ = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Float8E4M3FN)
        scale = quantize_group_fp8(rX, rQ, self.lanes, self.ue8m0)
        cute.autovec_copy(cute.recast_tensor(rQ, Int32), cute.local_tile(sQ, (self.elems_per_lane // 4,), (tidx,)))
        if cutlass.const_expr(self.token_scales):
            if lane == 0 and active:
                mTS[tok, group] = scale
        else:
            # A destination row is written when it lies in [0, end) (-1: expert not local), as an
            # unsigned compare.
            for m in cutlass.range_constexpr(self.entries_per_lane):
                ok = Uint32(entries[m]) < Uint32(end) and lane + m * self.lanes < self.k and active
                store_if(ok, s_base + Int64(entries[m]) * 4, scale.bitcast(Int32))
        # The codes written by st.shared must be visible to the bulk copies (the async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx < self.k:
            nbytes = cutlass.min(self.slab_groups, groups - slab * self.slab_groups) * GROUP
            q_base = mQ.iterator.toint() + Int64(slab * self.slab_groups * GROUP)
            for m in cutlass.range_constexpr(self.entries_per_lane):
                row = entries[m]
                if tidx // self.lanes == m and Uint32(row) < Uint32(end):
                    dst = q_base + Int64(cute.arch.mul_wide(Uint32(row), Uint32(mQ.stride[0])))
                    bulk_store(dst, sQ.iterator, nbytes)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory must outlive the reads

    @cute.jit
    def zero_padding(self, mR2T, mQ, mS, block, end, num_tokens, tidx):
        """Rows [256 b, 256 b + 256) of one slab of 8 group columns: each thread reads one row's token
        id; each warp then writes its padding rows one after another (a ballot of the 32 rows), each
        row's 1024 codes by the 32 lanes (two 16-byte stores each) and its 8 scales by 8 lanes."""
        groups = mQ.shape[1] // GROUP
        slabs = cute.ceil_div(groups, self.pad_groups)
        first_row = (block // slabs) * self.num_threads
        if first_row < end:
            slab = block % slabs
            row = first_row + tidx
            tok = mR2T[cutlass.min(row, end - 1)]
            mask = cutlass.Uint32(cute.arch.vote_ballot_sync(row < end and (tok < 0 or tok >= num_tokens)))
            lane = cute.arch.lane_idx()
            warp_first_row = first_row + tidx // 32 * 32
            zero_scale = zero_group_scale(self.ue8m0)
            vec = 16  # codes per 16-byte store
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint8, num_bits_per_copy=128)
            rZ = cute.make_rmem_tensor((vec,), cutlass.Uint8)
            rZ.fill(0)
            mCodes = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Uint8), mQ.layout)
            group = slab * self.pad_groups + lane
            while mask != 0:  # warp-uniform: one padding row per iteration
                i = cute.arch.bfind(mask)
                mask = mask ^ (cutlass.Uint32(1) << cutlass.Uint32(i))
                pad_row = warp_first_row + i
                for c in cutlass.range_constexpr(self.pad_groups * GROUP // vec // 32):
                    col = slab * (self.pad_groups * GROUP // vec) + c * 32 + lane
                    if col < mQ.shape[1] // vec:
                        cute.copy(store, rZ, cute.local_tile(mCodes[pad_row, None], (vec,), (col,)))
                # with token_scales, ScaleScatterKernel writes the padding rows' scales (coalesced)
                if cutlass.const_expr(not self.token_scales):
                    if lane < self.pad_groups and group < groups:
                        mS[pad_row, group] = zero_scale


class ScaleScatterKernel:
    """The token-major ``permute_quant``'s second launch at large T: ``a_scale[r, g] =
    token_scale[row_to_token[r], g]`` for every routed row ``r < end``; padding rows below ``end`` get
    the all-zero group's scale with ``padding_scales``, else stay untouched, as rows past ``end`` do.
    A thread takes one row and ``groups_per_thread`` group columns: it loads them from its token's
    row of ``token_scale`` (one 32-byte sector, two 16-byte loads: the scratch's rows are padded to
    a multiple of 8 groups) before its stores, which are coalesced along the rows (MN-major); CTAs
    of 256 rows by 8 group columns."""

    num_threads = 256
    groups_per_thread = 8

    def __init__(self, padding_scales: bool = False, ue8m0: bool = False):
        # padding_scales: padding rows (row_to_token -1 or outside [0, T)) below end get the scale
        # of an all-zero group (the zeroing CTAs of the first launch write their codes only).
        self.padding_scales = padding_scales
        self.ue8m0 = ue8m0

    @cute.jit
    def __call__(self, mTS, mR2T, mOff, mS, stream):
        grid = [cute.ceil_div(mS.shape[0], self.num_threads), cute.ceil_div(mS.shape[1], self.groups_per_thread), 1]
        self.kernel(mTS, mR2T, mOff, mS).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTS, mR2T, mOff, mS):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        row = bx * self.num_threads + tidx
        if row < rows_end(mOff, mS.shape[0]):
            tok = mR2T[row]
            groups = mS.shape[1]
            first = by * self.groups_per_thread
            rV = cute.make_rmem_tensor((self.groups_per_thread,), Float32)
            routed = tok >= 0 and tok < mTS.shape[0]  # -1 and ids outside [0, T): padding
            if routed:
                cute.autovec_copy(cute.local_tile(mTS[tok, None], (self.groups_per_thread,), (by,)), rV)
            elif cutlass.const_expr(self.padding_scales):
                rV.fill(zero_group_scale(self.ue8m0))
            if routed or cutlass.const_expr(self.padding_scales):
                for j in cutlass.range_constexpr(self.groups_per_thread):
                    if first + j < groups:
                        mS[row, first + j] = rV[j]


class PermuteKernel(_RowGather):
    """FP8 rows and their scales moved into expert order; no static options."""

    def __init__(self):
        super().__init__(1)

    @staticmethod
    def can_implement(hidden: int) -> str | None:
        if hidden % GROUP:
            return f"H must be a multiple of {GROUP}, got {hidden}"
        return None

    @cute.jit
    def __call__(self, mA, mSin, mR2T, mOff, mQ, mS, stream):
        self.kernel(mA, mSin, mR2T, mOff, mQ, mS).launch(
            grid=self.grid(mQ), block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mA, mSin, mR2T, mOff, mQ, mS):
        tidx, group, bidy, grid_y, end, chunk = self.coords(mOff, mQ)
        copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint8, num_bits_per_copy=128)
        sTok = self.alloc_tokens(cutlass.memory.SmemAllocator())
        for block in range(bidy, cute.ceil_div(end, self.rows_per_cta), grid_y):
            first_row = block * self.rows_per_cta + (tidx // self.lanes) * self.rows_per_thread
            self.stage_tokens(mR2T, sTok, block * self.rows_per_cta, end, mA.shape[0], tidx)
            toks, valids = self.row_tokens(sTok, tidx)
            # All codes and scale loads before the first store (no math in between to interleave).
            rAs, scales = [], []
            for u in cutlass.range_constexpr(self.rows_per_thread):
                rA = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Uint8)
                rA.fill(0)  # padding: codes 0 and scale 1.0, as reference.permute_ref
                scale = Float32(1.0)
                if valids[u]:
                    cute.copy(copy, cute.local_tile(mA[toks[u], None], (self.elems_per_lane,), (chunk,)), rA)
                    scale = mSin[toks[u], group]
                rAs.append(rA)
                scales.append(scale)
            for u in cutlass.range_constexpr(self.rows_per_thread):
                row = first_row + u
                if row < end:
                    cute.copy(copy, rAs[u], cute.local_tile(mQ[row, None], (self.elems_per_lane,), (chunk,)))
                    if tidx % self.lanes == 0:
                        mS[row, group] = scales[u]


def _fake_rows_io(in_dtype, num_tokens, hidden, m_cap, mn_major_scales: bool = False):
    """Fake tensors shared by the kernels: source rows, maps, codes and scales of any strides (or,
    with ``mn_major_scales``, of row stride 1: what the launch functions allocate)."""
    mX = fake_tensor(in_dtype, (num_tokens, hidden), (cute.sym_int64(divisibility=128 // in_dtype.width), 1))
    mR2T = fake_tensor(cutlass.Int32, (m_cap,), (1,), align=4)
    mOff = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
    mQ = fake_tensor(cutlass.Uint8, (m_cap, hidden), (cute.sym_int64(divisibility=16), 1))
    row_stride = 1 if mn_major_scales else cute.sym_int64()
    mS = fake_tensor(Float32, (m_cap, cute.sym_int()), (row_stride, cute.sym_int64()), align=4)
    return mX, mR2T, mOff, mQ, mS


@cached_compile
def compile_permute_quant(dtype: torch.dtype, ue8m0: bool, arch: str, keep_cubin: bool = False):
    """Compile for every T, H, M_cap, E and scale layout; the key is the scalars above."""
    cdtype = torch_to_cutlass_dtype(dtype)
    mX, mR2T, mOff, mQ, mS = _fake_rows_io(cdtype, cute.sym_int(), cute.sym_int(), cute.sym_int())
    return compile_kernel(PermuteQuantKernel(cdtype, ue8m0), mX, mR2T, mOff, mQ, mS, arch=arch, keep_cubin=keep_cubin)


def _fake_token_scales(num_tokens):
    """token_scale [T, H / 128 rounded up to 8] f32, row-major as the launch function allocates it."""
    groups = ScaleScatterKernel.groups_per_thread
    return fake_tensor(Float32, (num_tokens, cute.sym_int(divisibility=groups)),
                       (cute.sym_int64(divisibility=groups), 1))  # fmt: skip


@cached_compile
def compile_permute_quant_tokens(dtype: torch.dtype, ue8m0: bool, k: int, arch: str, keep_cubin: bool = False,
                                 zero_padding: bool = True, token_scales: bool = False):  # fmt: skip
    """Compile the token-major kernel for every T, H, M_cap and E (MN-major scales: row stride 1);
    the key adds k, whether padding rows are zeroed and where the scales go."""
    cdtype = torch_to_cutlass_dtype(dtype)
    num_tokens = cute.sym_int()
    mX, mR2T, mOff, mQ, mS = _fake_rows_io(cdtype, num_tokens, cute.sym_int(), cute.sym_int(), True)
    mT2R = fake_tensor(cutlass.Int32, (num_tokens, k), (cute.sym_int64(), cute.sym_int64()), align=4)
    # without token_scales the launch passes a_scale again in its place (never read)
    mTS = _fake_token_scales(num_tokens) if token_scales else mS
    kernel = TokenPermuteQuantKernel(cdtype, ue8m0, k, zero_padding, token_scales)
    return compile_kernel(kernel, mX, mT2R, mR2T, mOff, mQ, mS, mTS, arch=arch, keep_cubin=keep_cubin)


@cached_compile
def compile_scale_scatter(arch: str, keep_cubin: bool = False, padding_scales: bool = False, ue8m0: bool = False):
    """Compile ``ScaleScatterKernel`` for every T, H / 128, M_cap and E."""
    _, mR2T, mOff, _, mS = _fake_rows_io(cutlass.BFloat16, cute.sym_int(), cute.sym_int(), cute.sym_int(), True)
    mTS = _fake_token_scales(cute.sym_int())
    kernel = ScaleScatterKernel(padding_scales, ue8m0)
    return compile_kernel(kernel, mTS, mR2T, mOff, mS, arch=arch, keep_cubin=keep_cubin)


@cached_compile
def compile_permute(arch: str, keep_cubin: bool = False):
    """Compile for every T, H, M_cap, E and input scale layout."""
    num_tokens = cute.sym_int()
    mA, mR2T, mOff, mQ, mS = _fake_rows_io(cutlass.Uint8, num_tokens, cute.sym_int(), cute.sym_int())
    mSin = fake_tensor(Float32, (num_tokens, cute.sym_int()), (cute.sym_int64(), cute.sym_int64()), align=4)
    return compile_kernel(PermuteKernel(), mA, mSin, mR2T, mOff, mQ, mS, arch=arch, keep_cubin=keep_cubin)


def _nonempty_rows(t: torch.Tensor) -> torch.Tensor:
    """With T = 0 every row is padding and the source is never read; the call still gets a
    one-row tensor rather than an empty one."""
    return t if t.shape[0] else t.new_zeros((1, t.shape[1]))


def permute_quant_cuda(
    x: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor, scale_fmt=None, token_to_row=None,
    zero_padding: bool = True,
):  # fmt: skip
    """Launch on x's device and current stream; inputs already validated by the op layer.

    With ``token_to_row`` the token-major kernel runs (the row-major one for a top-k outside
    [1, 32]); without it the row-major one.  Both write the same outputs.  ``zero_padding=False``
    leaves the padding rows unwritten in the token-major kernel (the row-major one writes them
    anyway: it quantizes a padding row in the same pass as a routed one)."""
    m_cap, hidden = row_to_token.shape[0], x.shape[1]
    a, a_scale = checked_outputs(
        "permute_quant", "x", x, PermuteQuantKernel.can_implement(x.dtype, hidden), m_cap, hidden
    )
    if a.numel() == 0:
        return a, a_scale
    ue8m0, arch = scale_fmt == "ue8m0", arch_of_device(x.device)
    k = 0 if token_to_row is None else token_to_row.shape[1]
    if token_to_row is None or TokenPermuteQuantKernel.can_implement(x.dtype, hidden, k) is not None:
        compile_permute_quant(x.dtype, ue8m0, arch)(
            _nonempty_rows(x), row_to_token, expert_offsets, a.view(torch.uint8), a_scale
        )
        return a, a_scale
    # The kernel reads int32 rows.  An int64 entry outside int32 lies outside [0, M_cap) and is
    # skipped like -1; a plain narrowing would wrap it onto some row (the debug mode names it).
    t2r = token_to_row
    if t2r.dtype != torch.int32:
        t2r = torch.where((t2r >= -1) & (t2r <= INT32_MAX), t2r, -1).to(torch.int32)
    if x.shape[0] == 0:  # no token: one placeholder token routed nowhere (the zeroing CTAs, if any, still run)
        t2r = t2r.new_full((1, k), -1)
    token_scales = x.shape[0] >= TOKEN_SCALES_MIN_TOKENS
    scales_out = a_scale
    if token_scales:
        per_thread = ScaleScatterKernel.groups_per_thread
        scales_out = a_scale.new_empty(x.shape[0], -(-hidden // GROUP // per_thread) * per_thread)
    compile_permute_quant_tokens(x.dtype, ue8m0, k, arch, False, zero_padding, token_scales)(
        _nonempty_rows(x), t2r, row_to_token, expert_offsets, a.view(torch.uint8), a_scale, scales_out
    )
    if token_scales:
        # (the scale format matters only for the padding rows' scale: one binary without them)
        compile_scale_scatter(arch, False, zero_padding, ue8m0 and zero_padding)(
            scales_out, row_to_token, expert_offsets, a_scale
        )
    return a, a_scale


def permute_cuda(a_in: torch.Tensor, a_in_scale: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor):
    """Launch on a_in's device and current stream; inputs already validated by the op layer."""
    reason = PermuteKernel.can_implement(a_in.shape[1])
    a, a_scale = checked_outputs("permute", "a_in", a_in, reason, row_to_token.shape[0], a_in.shape[1])
    if a.numel() == 0:
        return a, a_scale
    codes = a_in.view(torch.uint8)
    if a_in.shape[0] == 0:
        codes, a_in_scale = _nonempty_rows(codes), a_in_scale.new_ones((1, a_in_scale.shape[1]))
    fn = compile_permute(arch_of_device(a_in.device))
    fn(codes, a_in_scale, row_to_token, expert_offsets, a.view(torch.uint8), a_scale)
    return a, a_scale


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect permute_quant``."""
    bf16 = torch_to_cutlass_dtype(torch.bfloat16)
    quant_smem = PermuteQuantKernel(bf16, False).smem_bytes()
    token_smem = TokenPermuteQuantKernel(bf16, False, 8).smem_bytes()
    fmts = ("none", "ue8m0")
    return (
        [
            (
                f"permute_quant[bfloat16, scale_fmt={fmt}]",
                compile_permute_quant(torch.bfloat16, fmt == "ue8m0", arch, True),
                quant_smem,
            )
            for fmt in fmts
        ]
        + [
            (
                f"permute_quant[bfloat16, token-major, k={k}, scale_fmt={fmt}]",
                compile_permute_quant_tokens(torch.bfloat16, fmt == "ue8m0", k, arch, True),
                token_smem,
            )
            for k, fmt in ((8, "none"), (8, "ue8m0"), (20, "none"))
        ]
        + [
            (
                "permute_quant[bfloat16, token-major, k=8, scale_fmt=none, padding rows not written]",
                compile_permute_quant_tokens(torch.bfloat16, False, 8, arch, True, False),
                token_smem,
            ),
            (
                "permute_quant[bfloat16, token-major, k=8, scale_fmt=none, padding rows not written, token scales]",
                compile_permute_quant_tokens(torch.bfloat16, False, 8, arch, True, False, True),
                token_smem,
            ),
            ("permute_quant scale scatter", compile_scale_scatter(arch, True), 0),
            ("permute_quant scale scatter, padding rows", compile_scale_scatter(arch, True, True), 0),
        ]
        + [("permute[float8_e4m3fn]", compile_permute(arch, True), PermuteKernel().smem_bytes())]
    )
