"""FP8 paged KV-cache fill (``cute_moe.fill_kv_cache_fp8``) as a CuTe DSL kernel.

Semantics (lmdeploy's ``fill_kv_cache_blocked_fp8``): new token ``j`` of
sequence ``b`` (global token ``t = cu_seqlens_q[b] + j``) lands at position
``pos = kv_seqlens[b] - q_len_b + j``, i.e. block ``block_offsets[b, pos // bs]``,
slot ``pos % bs``; each (token, head, group of ``G`` channels) is quantized with
the contract's formula (``fp8_group.quantize_group_fp8``): codes into the FP8
cache, the f32 scale into the scale cache. Nothing else in the caches changes.
Tokens before ``cu_seqlens_q[0]`` or past ``cu_seqlens_q[-1]`` (in no sequence),
negative positions, block indices past ``max_blocks`` and block ids outside
``[0, num_blocks)`` are not written (the kernel never writes out of bounds;
``CUTE_MOE_DEBUG=1`` makes the op check the block table on the host and raise for
an entry outside ``[-1, num_blocks)``; -1 entries are still skipped).

Layouts: the host hands the kernel every cache as a logical
``[num_blocks, block_size, H, D]`` view with its own strides (a ``bhsd`` cache is
passed transposed), so one kernel serves both layouts.  Contiguous caches with
per-token-contiguous states (the usual case: K and V split from a fused QKV
output) get a variant compiled with those strides as constants (keyed on layout
and block size), whose addressing folds into a few adds; any other strides get
the variant with every stride a runtime value.

Mapping: a warp owns up to two consecutive tokens (as many as keep each lane's
loads within 128 bytes: 1 token for Llama-style K+V, 2 for MLA K-only).  The
token's ``H * D / G`` groups are covered ``32 / L`` per warp pass, ``L`` lanes per
group (half the lanes that 16 bytes each would need, at most 16: a lane holds two
or more 16-byte vectors of its group, interleaved with the other lanes' so that
every load is coalesced; per element that halves the amax shuffles and the
per-group scalar work).  With the head count a compile-time constant every pass unrolls, and all
loads of the warp's tokens are issued before the destination look-up and any
math.  The look-up: the token's sequence is the count of ``cu_seqlens_q[1:] <= t``
(each lane counts a strided share, then a warp sum: independent loads instead of
a dependent binary search; the lane holding the token's sequence keeps its
bounds and length for a shuffle), then the block table is read: two memory round
trips, overlapped with the loads of the token's states.  The floor is HBM
bandwidth: read K and V once, write codes and scales once.

Small batches (fewer than 4096 tokens, decode) cannot fill the GPU, and a
token's serial math on one warp is then what the step waits for: one token per
warp, its passes split over up to 4 warps, and the sequence look-up first
checks whether token ``t`` lies in sequence ``min(t, B - 1)`` (always so in pure
decode), which saves the counting round trips when right.

Constraints (``FillKvCacheFp8Kernel.can_implement``): states bf16/fp16/f32 with
unit channel stride and 16-byte aligned token and head strides; G a power of two
in [32, 1024] dividing D (and Dv); cache strides multiples of 16 bytes.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from ..validation import INT32_MAX
from .fp8_group import lanes_per_group, quantize_group_fp8
from .host_checks import check_rows_16b, debug_check_index_range

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WARPS_PER_CTA = 4  # default; the launcher may override (benchmark sweeps)
_BYTES_IN_FLIGHT_PER_LANE = 128  # a warp batches tokens until its lanes' loads reach this
# Below this many tokens the small-batch variant (decode): one token per warp, split over warps.
_SMALL_BATCH_TOKENS = 4096
# Sequences per lane per round of the sequence look-up (loads issued together): 4 in the
# small-batch variant (B = 64..128 decode sequences in one round trip), 1 otherwise (registers).
_LOOKUP_PER_LANE = {True: 4, False: 1}
_MAX_WARPS_PER_TOKEN, _MIN_PASSES_PER_WARP = 4, 2  # small-batch variant: a token's passes over warps


class FillKvCacheFp8Kernel:
    """Static configuration: states dtype, heads, head dims, group size, scale format, K-only or K+V.

    The head count is static (a model constant): the (head, group) walk of a token then
    unrolls completely, so every load of a warp's tokens is issued before any math.
    """

    def __init__(
        self, dtype, heads: int, head_dim: int, head_dim_v: int | None, group_size: int, ue8m0: bool,
        max_tokens_per_warp: int = 2, small_batch: bool = False, warps_per_cta: int = _WARPS_PER_CTA,
    ):  # fmt: skip
        self.dtype = dtype
        self.heads = heads
        self.head_dims = (head_dim,) if head_dim_v is None else (head_dim, head_dim_v)
        self.group_size = group_size
        self.ue8m0 = ue8m0
        # Half the lanes per group that 16-byte lanes would need, each with twice the elements
        # (fewer shuffles and per-group scalar work per element). A lane's elements are 16-byte
        # vectors interleaved with the other lanes' (vector j of lane l at j * lanes + l), so each
        # load is coalesced.
        self.lanes = max(1, lanes_per_group(dtype.width // 8, group_size) // 2)
        self.elems_per_lane = group_size // self.lanes
        self.vec = 128 // dtype.width
        self.vecs_per_lane = self.elems_per_lane // self.vec
        self.groups_per_pass = 32 // self.lanes
        side_bytes = [self.passes(d) * self.elems_per_lane * dtype.width // 8 for d in self.head_dims]
        self.tokens_per_warp = max(1, min(max_tokens_per_warp, _BYTES_IN_FLIGHT_PER_LANE // sum(side_bytes)))
        # Both sides' loads up front when they fit the budget together (one token of Llama-style
        # K+V): the V loads then overlap the destination look-up too. Otherwise K's, then V's,
        # which keeps registers (and so occupancy) in check.
        self.sides_together = len(side_bytes) == 2 and sum(side_bytes) * self.tokens_per_warp <= _BYTES_IN_FLIGHT_PER_LANE
        # A warp's work for a token: its "part", a tuple of (side, first pass, end pass). A small
        # batch (decode) has too few tokens to fill the GPU, and a token's serial math on one warp
        # is then what the step waits for: each side's passes go to warps of `chunk` passes (at
        # least _MIN_PASSES_PER_WARP), at most _MAX_WARPS_PER_TOKEN warps in all. There the
        # token's sequence is also guessed first (see `destinations`).
        self.small_batch = small_batch
        passes = [self.passes(d) for d in self.head_dims]
        if small_batch and self.tokens_per_warp == 1:
            chunk = max(_MIN_PASSES_PER_WARP, -(-sum(passes) // _MAX_WARPS_PER_TOKEN))
            while sum(-(-n // chunk) for n in passes) > _MAX_WARPS_PER_TOKEN:  # sides split separately
                chunk += 1
            self.parts = [((side, p0, min(p0 + chunk, n)),) for side, n in enumerate(passes) for p0 in range(0, n, chunk)]
        else:
            self.parts = [tuple((side, 0, n) for side, n in enumerate(passes))]
        self.cta_warps = max(1, warps_per_cta // len(self.parts)) * len(self.parts)
        self.tokens_per_cta = self.tokens_per_warp * self.cta_warps // len(self.parts)

    def passes(self, head_dim: int) -> int:
        """Warp passes over one token's heads * head_dim / G groups."""
        return -(-self.heads * (head_dim // self.group_size) // self.groups_per_pass)

    @staticmethod
    def can_implement(dtype: torch.dtype, head_dim: int, head_dim_v: int | None, group_size: int) -> str | None:
        if dtype not in SUPPORTED_DTYPES:
            return f"k_states dtype must be one of {SUPPORTED_DTYPES}, got {dtype}"
        if group_size < 32 or group_size > 1024 or group_size & (group_size - 1):
            return f"group_size must be a power of two in [32, 1024], got {group_size}"
        for name, d in (("D", head_dim), ("Dv", head_dim_v)):
            if d is not None and d % group_size:
                return f"{name} = {d} must be a multiple of group_size = {group_size}"
        return None

    @cute.jit
    def __call__(self, mK, mKC, mKS, mV, mVC, mVS, mCu, mKvLen, mBlk, stream):
        mKC = cute.make_tensor(cute.recast_ptr(mKC.iterator, dtype=cutlass.Float8E4M3FN), mKC.layout)
        if cutlass.const_expr(len(self.head_dims) == 2):
            mVC = cute.make_tensor(cute.recast_ptr(mVC.iterator, dtype=cutlass.Float8E4M3FN), mVC.layout)
        self.kernel(mK, mKC, mKS, mV, mVC, mVS, mCu, mKvLen, mBlk).launch(
            grid=[cute.ceil_div(mK.shape[0], self.tokens_per_cta), 1, 1],
            block=[32 * self.cta_warps, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mK, mKC, mKS, mV, mVC, mVS, mCu, mKvLen, mBlk):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        sides = [(mK, mKC, mKS)]
        if cutlass.const_expr(len(self.head_dims) == 2):
            sides.append((mV, mVC, mVS))
        lookup = (mCu, mKvLen, mBlk, mKC, mK.shape[0])
        first_token = bidx * self.tokens_per_cta + (warp // len(self.parts)) * self.tokens_per_warp
        if cutlass.const_expr(len(self.parts) == 1):
            self.fill(self.parts[0], sides, lookup, first_token, lane)
        else:
            for i in cutlass.range_constexpr(len(self.parts)):
                if warp % len(self.parts) == i:
                    self.fill(self.parts[i], sides, lookup, first_token, lane)

    @cute.jit
    def fill(self, part: cutlass.Constexpr, sides: list, lookup, first_token, lane):
        """Quantize the passes of ``part`` ((side, first pass, end pass), ...) of the warp's tokens;
        ``sides``: (states, codes, scales) of K and V; ``lookup``: what ``destinations`` reads."""
        # K, then V: all of a side's loads for the warp's tokens are issued first. The first
        # side's loads depend on the token index only, so they are in flight while the warp
        # works out where its tokens go.
        blocks, slots = None, None
        batches = [part] if cutlass.const_expr(self.sides_together) else [[piece] for piece in part]
        for batch in batches:
            loaded = self.new_buffers(batch)
            self.load(batch, sides, loaded, first_token, lookup[4], lane)
            if cutlass.const_expr(blocks is None):
                blocks, slots = self.destinations(*lookup, first_token, lane)
            self.quantize_store(batch, sides, loaded, blocks, slots, lane)

    def new_buffers(self, pieces) -> list:
        """Registers for one load of ``pieces`` ((side, first pass, end pass), ...): one tensor of
        the lane's elements of a group per (piece, token, pass)."""
        return [
            cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
            for _, p0, p1 in pieces for _ in range(self.tokens_per_warp) for _ in range(p0, p1)
        ]  # fmt: skip

    @cute.jit
    def load(self, pieces: cutlass.Constexpr, sides: list, bufs: list, first_token, num_tokens, lane):
        """Issue the loads of ``pieces`` of the tokens from ``first_token`` into ``bufs``. Loads are
        never predicated: a token past the end re-reads the last token and a lane group past the
        last group re-reads it, so that all lanes join the amax shuffles; only stores are."""
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        i = 0
        for side, p0, p1 in pieces:
            mX, head_dim = sides[side][0], self.head_dims[side]
            for w in cutlass.range_constexpr(self.tokens_per_warp):
                for p in cutlass.range_constexpr(p0, p1):
                    head, group, _ = self.unit(p, head_dim, lane)
                    token = cutlass.min(first_token + w, num_tokens - 1)
                    for j in cutlass.range_constexpr(self.vecs_per_lane):
                        src = cute.local_tile(mX[token, head, None], (self.vec,), (self.vector(group, j, lane),))
                        cute.copy(load, src, cute.local_tile(bufs[i], (self.vec,), (j,)))
                    i += 1

    @cute.jit
    def quantize_store(self, pieces: cutlass.Constexpr, sides: list, loaded: list, blocks, slots, lane):
        """Quantize ``loaded`` and store codes and scales of the tokens with a block (>= 0)."""
        store = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=8 * self.vec
        )
        i = 0
        for side, p0, p1 in pieces:
            _, mC, mS = sides[side]
            head_dim = self.head_dims[side]
            for w in cutlass.range_constexpr(self.tokens_per_warp):
                for p in cutlass.range_constexpr(p0, p1):
                    head, group, ok = self.unit(p, head_dim, lane)
                    rQ = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Float8E4M3FN)
                    scale = quantize_group_fp8(loaded[i], rQ, self.lanes, self.ue8m0)
                    i += 1
                    if blocks[w] >= 0 and ok:
                        for j in cutlass.range_constexpr(self.vecs_per_lane):
                            dst = cute.local_tile(mC[blocks[w], slots[w], head, None], (self.vec,),
                                                  (self.vector(group, j, lane),))  # fmt: skip
                            cute.copy(store, cute.local_tile(rQ, (self.vec,), (j,)), dst)
                        if lane % self.lanes == 0:
                            mS[blocks[w], slots[w], head, group] = scale

    @cute.jit
    def vector(self, group, j: cutlass.Constexpr, lane):
        """Index (in 16-byte vectors of a head's row) of this lane's j-th vector of ``group``."""
        return group * (self.group_size // self.vec) + j * self.lanes + lane % self.lanes

    @cute.jit
    def unit(self, p: cutlass.Constexpr, head_dim: cutlass.Constexpr, lane):
        """(head, group, in range) of the group this lane's lane-group covers in pass p; a lane
        group past the token's last group is pointed at that group (its stores are skipped)."""
        groups_per_head = head_dim // self.group_size
        num_groups = self.heads * groups_per_head
        g = p * self.groups_per_pass + lane // self.lanes
        in_range = g < num_groups
        if cutlass.const_expr(num_groups % self.groups_per_pass != 0):
            g = cutlass.min(g, num_groups - 1)
        return g // groups_per_head, g % groups_per_head, in_range

    @cute.jit
    def destinations(self, mCu, mKvLen, mBlk, mKC, num_tokens, first_token, lane):
        """(block, slot) of each of the warp's tokens; block -1 when a token is not written."""
        # A token's sequence: how many sequence ends cu_seqlens_q[1..B] are <= token. Each lane
        # counts a strided share for all the warp's tokens at once, then a warp sum per token.
        # In the same pass the lane whose sequence holds the token keeps that sequence's
        # (q_start, q_end, kv_len), broadcast afterwards by a shuffle: one round trip to
        # memory instead of two before the block-table read.
        num_seqs = mCu.shape[0] - 1
        counts = cute.make_rmem_tensor((self.tokens_per_warp,), Int32)
        counts.fill(0)
        found = cute.make_rmem_tensor((self.tokens_per_warp, 3), Int32)
        found.fill(0)
        hit = Int32(0)
        if cutlass.const_expr(self.small_batch and self.tokens_per_warp == 1):
            # Guess: the token lies in sequence min(token, B - 1). When it does, that is what the
            # count gives for ordered cu_seqlens_q (the ends before it are <= token, the rest
            # > token), and the counting round trips (one per 128 sequences) are saved.
            guess = cutlass.min(first_token, num_seqs - 1)
            if num_seqs > 0:  # (the launcher never launches for B = 0; no read past cu_seqlens_q)
                q_start, q_end, kv_len = mCu[guess], mCu[guess + 1], mKvLen[guess]
                if q_start <= first_token and first_token < q_end:
                    hit = Int32(1)
                    found[0, 0], found[0, 1], found[0, 2] = q_start, q_end, kv_len
                    counts[0] = guess
        if hit == 0:
            # Each lane loads the bounds of `per_lane` sequences per round, all issued before the
            # first compare.
            per_lane = _LOOKUP_PER_LANE[self.small_batch]
            for base in cutlass.range(0, num_seqs, 32 * per_lane, unroll=1):
                lo = cute.make_rmem_tensor((per_lane,), Int32)
                hi = cute.make_rmem_tensor((per_lane,), Int32)
                kv = cute.make_rmem_tensor((per_lane,), Int32)
                for j in cutlass.range_constexpr(per_lane):
                    i = base + j * 32 + lane
                    lo[j], hi[j], kv[j] = Int32(INT32_MAX), Int32(INT32_MAX), Int32(0)  # past B: counts nothing
                    if i < num_seqs:
                        lo[j], hi[j], kv[j] = mCu[i], mCu[i + 1], mKvLen[i]
                for j in cutlass.range_constexpr(per_lane):
                    for w in cutlass.range_constexpr(self.tokens_per_warp):
                        token = first_token + w
                        if hi[j] <= token:
                            counts[w] = counts[w] + 1
                        if lo[j] <= token and token < hi[j]:
                            found[w, 0], found[w, 1], found[w, 2] = lo[j], hi[j], kv[j]
        blocks, slots = [], []
        block_size = mKC.shape[1]
        for w in cutlass.range_constexpr(self.tokens_per_warp):
            token = first_token + w
            seq, q_start, q_end, kv_len = counts[w], found[w, 0], found[w, 1], found[w, 2]
            if hit == 0:
                seq = cute.arch.warp_reduction_sum(counts[w])
                owner = seq % 32
                q_start = cute.arch.shuffle_sync(found[w, 0], owner)
                q_end = cute.arch.shuffle_sync(found[w, 1], owner)
                kv_len = cute.arch.shuffle_sync(found[w, 2], owner)
            block, slot = Int32(-1), Int32(0)
            # q_start <= token: a token before cu_seqlens_q[0] is in no sequence (its look-up found
            # nothing and left zeros, which would make it position `token` of sequence 0)
            if token < num_tokens and seq < num_seqs and q_start <= token and token < q_end:
                pos = kv_len - (q_end - q_start) + (token - q_start)
                if pos >= 0 and pos // block_size < mBlk.shape[1]:
                    candidate = mBlk[seq, pos // block_size]
                    if candidate >= 0 and candidate < mKC.shape[0]:
                        block, slot = candidate, pos % block_size
            blocks.append(block)
            slots.append(slot)
        return blocks, slots


def _static_strides(layout: str, block_size: int, heads: int, dim: int) -> tuple:
    """Strides of a contiguous cache of ``layout`` seen as [num_blocks, block_size, H, dim]."""
    if layout == "bshd":
        return (block_size * heads * dim, heads * dim, dim, 1)
    return (heads * block_size * dim, dim, block_size * dim, 1)


def _fake_side(cdtype, head_dim: int, group_size: int, num_tokens, heads: int, contiguous):
    """Fake (states, codes cache, scale cache) for one of K / V.

    ``contiguous`` is None (any strides: every stride a runtime value) or (layout, block_size)
    for contiguous caches and per-token-contiguous states: then every stride but the token
    stride is a compile-time constant and the addressing folds into a few adds.
    """
    vec = 128 // cdtype.width
    blocks = cute.sym_int()
    if contiguous is None:
        block_size = cute.sym_int()
        states_stride = (cute.sym_int64(divisibility=vec), cute.sym_int64(divisibility=vec), 1)
        cache_stride = (cute.sym_int64(divisibility=16),) * 3 + (1,)
        scale_stride = tuple(cute.sym_int64() for _ in range(4))
    else:
        layout, block_size = contiguous
        states_stride = (cute.sym_int64(divisibility=vec), head_dim, 1)
        cache_stride = _static_strides(layout, block_size, heads, head_dim)
        scale_stride = _static_strides(layout, block_size, heads, head_dim // group_size)
    states = fake_tensor(cdtype, (num_tokens, heads, head_dim), states_stride)
    cache = fake_tensor(cutlass.Uint8, (blocks, block_size, heads, head_dim), cache_stride)
    scales = fake_tensor(cutlass.Float32, (blocks, block_size, heads, head_dim // group_size), scale_stride, align=4)
    return states, cache, scales


@cached_compile
def compile_fill_kv_cache_fp8(
    dtype: torch.dtype, heads: int, head_dim: int, head_dim_v, group_size: int, ue8m0: bool, contiguous, arch: str,
    keep_cubin: bool = False, max_tokens_per_warp: int = 2, small_batch: bool = False,
    warps_per_cta: int = _WARPS_PER_CTA,
):  # fmt: skip
    """Compile for any token count, batch and cache size; keyed on the scalars above
    (``contiguous``: None, or (layout, block_size) for the static-stride variant; ``small_batch``:
    the decode variant, for fewer than _SMALL_BATCH_TOKENS tokens)."""
    cdtype = torch_to_cutlass_dtype(dtype)
    num_tokens, batch = cute.sym_int(), cute.sym_int()
    k_side = _fake_side(cdtype, head_dim, group_size, num_tokens, heads, contiguous)
    v_side = (
        (None, None, None) if head_dim_v is None
        else _fake_side(cdtype, head_dim_v, group_size, num_tokens, heads, contiguous)
    )  # fmt: skip
    cu = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
    kv_len = fake_tensor(cutlass.Int32, (batch,), (1,), align=4)
    block_offsets = fake_tensor(cutlass.Int32, (batch, cute.sym_int()), (cute.sym_int64(), 1), align=4)
    kernel = FillKvCacheFp8Kernel(cdtype, heads, head_dim, head_dim_v, group_size, ue8m0, max_tokens_per_warp,
                                  small_batch, warps_per_cta)  # fmt: skip
    return compile_kernel(kernel, *k_side, *v_side, cu, kv_len, block_offsets, arch=arch, keep_cubin=keep_cubin)


def _as_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bhsd" else t


def fill_kv_cache_fp8_cuda(
    k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache,
    cu_seqlens_q, kv_seqlens, block_offsets, group_size, scale_fmt, layout,
    max_tokens_per_warp: int | None = None, small_batch: bool | None = None, warps_per_cta: int = _WARPS_PER_CTA,
) -> None:  # fmt: skip
    """Launch on the states' device and current stream; inputs already validated by the op layer.
    ``max_tokens_per_warp``, ``small_batch`` and ``warps_per_cta`` override the defaults (benchmarks,
    tests)."""
    head_dim_v = None if v_states is None else v_states.shape[2]
    reason = FillKvCacheFp8Kernel.can_implement(k_states.dtype, k_states.shape[2], head_dim_v, group_size)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.fill_kv_cache_fp8: no CUDA kernel for this input: {reason}")
    sides = [("k", k_states, k_cache, k_scale_cache)]
    if v_states is not None:
        sides.append(("v", v_states, v_cache, v_scale_cache))
    args = []
    for name, states, cache, scales in sides:
        check_rows_16b("fill_kv_cache_fp8", f"{name}_states", states)
        cache_bshd = _as_bshd(cache, layout)
        check_rows_16b("fill_kv_cache_fp8", f"{name}_cache", cache_bshd)
        args += [states, cache_bshd.view(torch.uint8), _as_bshd(scales, layout)]
    if v_states is None:
        args += [None, None, None]
    debug_check_index_range("fill_kv_cache_fp8", "block_offsets", block_offsets, k_cache.shape[0])
    if k_states.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        return
    contiguous = (layout, k_cache.shape[1 if layout == "bshd" else 2])
    for _, states, cache, scales in sides:
        if not (cache.is_contiguous() and scales.is_contiguous() and states.stride(1) == states.shape[2]):
            contiguous = None
    if small_batch is None:
        small_batch = k_states.shape[0] < _SMALL_BATCH_TOKENS
    fn = compile_fill_kv_cache_fp8(
        k_states.dtype, k_states.shape[1], k_states.shape[2], head_dim_v, group_size, scale_fmt == "ue8m0",
        contiguous, arch_of_device(k_states.device), False, max_tokens_per_warp or (1 if small_batch else 2),
        small_batch, warps_per_cta,
    )  # fmt: skip
    fn(*args, cu_seqlens_q, kv_seqlens, block_offsets)


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect fill_kv_cache_fp8``."""
    return [
        (
            f"fill_kv_cache_fp8[bfloat16, H_kv={h}, D={d}, Dv={dv}, group={g}, scale_fmt={fmt}, "
            f"{'any strides' if contiguous is None else 'contiguous %s, block %d' % contiguous}"
            f"{', small batch' if small else ''}]",
            compile_fill_kv_cache_fp8(torch.bfloat16, h, d, dv, g, fmt == "ue8m0", contiguous, arch, True,
                                      1 if small else 2, small),  # fmt: skip
            0,
        )
        for h, d, dv, g, fmt, contiguous, small in [
            (8, 128, 128, 128, "none", ("bshd", 64), False),
            (8, 128, 128, 128, "ue8m0", ("bhsd", 64), False),
            (1, 512, None, 128, "none", ("bshd", 64), False),
            (8, 128, 128, 128, "none", None, False),
            (8, 128, 128, 128, "none", ("bshd", 64), True),
            (1, 512, None, 128, "none", ("bshd", 64), True),
        ]
    ]
