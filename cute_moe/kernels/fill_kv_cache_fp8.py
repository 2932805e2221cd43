"""FP8 paged KV-cache fill (``cute_moe.fill_kv_cache_fp8``) as a CuTe DSL kernel.

Semantics (lmdeploy's ``fill_kv_cache_blocked_fp8``): new token ``j`` of
sequence ``b`` (global token ``t = cu_seqlens_q[b] + j``) lands at position
``pos = kv_seqlens[b] - q_len_b + j``, i.e. block ``block_offsets[b, pos // bs]``,
slot ``pos % bs``; each (token, head, group of ``G`` channels) is quantized with
the contract's formula (``fp8_group.quantize_group_fp8``): codes into the FP8
cache, the f32 scale into the scale cache. Nothing else in the caches changes.
Tokens past ``cu_seqlens_q[-1]``, negative positions, block indices past
``max_blocks`` and block ids outside ``[0, num_blocks)`` are not written (the
kernel never writes out of bounds; ``CUTE_MOE_DEBUG=1`` makes the op check block
ids on the host and raise instead).

Layouts: the host hands the kernel every cache as a logical
``[num_blocks, block_size, H, D]`` view with its own strides (a ``bhsd`` cache is
passed transposed), so one kernel serves both layouts.

Mapping: one warp per token.  The warp finds the token's sequence by counting
``cu_seqlens_q[1:] <= t`` (each lane counts a strided share, then a warp sum:
independent loads instead of a dependent binary search, so decode stays at one
memory round trip), then walks the token's ``H * D / G`` groups, ``32 / L``
groups per pass (``L`` lanes per group, 16 bytes per lane per load), with the
loads of 4 passes of K and V issued before any math.  The floor is HBM
bandwidth: read K and V once, write codes and scales once.

Constraints (``FillKvCacheFp8Kernel.can_implement``): states bf16/fp16/f32 with
unit channel stride and 16-byte aligned token and head strides; G a power of two
in [32, 1024] dividing D (and Dv); cache strides multiples of 16 bytes.
"""
from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from .fp8_group import lanes_per_group, quantize_group_fp8

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WARPS_PER_CTA = 4
_PASSES_IN_FLIGHT = 4


class FillKvCacheFp8Kernel:
    """Static configuration: states dtype, head dims, group size, scale format, K-only or K+V."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int | None, group_size: int, ue8m0: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.group_size = group_size
        self.ue8m0 = ue8m0
        self.lanes = lanes_per_group(dtype.width // 8, group_size)
        self.elems_per_lane = group_size // self.lanes
        self.groups_per_pass = 32 // self.lanes
        self.num_threads = 32 * _WARPS_PER_CTA

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
        if cutlass.const_expr(self.head_dim_v is not None):
            mVC = cute.make_tensor(cute.recast_ptr(mVC.iterator, dtype=cutlass.Float8E4M3FN), mVC.layout)
        self.kernel(mK, mKC, mKS, mV, mVC, mVS, mCu, mKvLen, mBlk).launch(
            grid=[cute.ceil_div(mK.shape[0], _WARPS_PER_CTA), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mK, mKC, mKS, mV, mVC, mVS, mCu, mKvLen, mBlk):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        token = bidx * _WARPS_PER_CTA + tidx // 32
        num_tokens = mK.shape[0]
        num_seqs = mCu.shape[0] - 1

        # Sequence of this token: how many sequence ends cu_seqlens_q[1..B] are <= token.
        seq = Int32(0)
        for i in range(lane, num_seqs, 32):
            if mCu[i + 1] <= token:
                seq += 1
        seq = cute.arch.warp_reduction_sum(seq)

        block, slot = Int32(-1), Int32(0)
        if token < num_tokens and seq < num_seqs:
            q_start = mCu[seq]
            pos = mKvLen[seq] - (mCu[seq + 1] - q_start) + (token - q_start)
            block_size = mKC.shape[1]
            if pos >= 0 and pos // block_size < mBlk.shape[1]:
                candidate = mBlk[seq, pos // block_size]
                if candidate >= 0 and candidate < mKC.shape[0]:
                    block, slot = candidate, pos % block_size
        if block >= 0:  # warp-uniform: the whole warp shares one token
            self.fill(mK, mKC, mKS, self.head_dim, token, block, slot, lane)
            if cutlass.const_expr(self.head_dim_v is not None):
                self.fill(mV, mVC, mVS, self.head_dim_v, token, block, slot, lane)

    @cute.jit
    def fill(self, mX, mC, mS, head_dim: cutlass.Constexpr, token, block, slot, lane):
        """Quantize token's [H, head_dim] states into cache slot (block, slot), one warp."""
        groups_per_head = head_dim // self.group_size
        num_groups = mX.shape[1] * groups_per_head
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        store = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=min(128, 8 * self.elems_per_lane)
        )
        lane_in_group = lane % self.lanes
        per_iter = self.groups_per_pass * _PASSES_IN_FLIGHT
        for first in range(0, num_groups, per_iter):
            rXs = []
            for p in cutlass.range_constexpr(_PASSES_IN_FLIGHT):
                g = first + p * self.groups_per_pass + lane // self.lanes
                rX = cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
                rX.fill(0.0)
                if g < num_groups:
                    head, chunk = g // groups_per_head, (g % groups_per_head) * self.lanes + lane_in_group
                    cute.copy(load, cute.local_tile(mX[token, head, None], (self.elems_per_lane,), (chunk,)), rX)
                rXs.append(rX)
            for p in cutlass.range_constexpr(_PASSES_IN_FLIGHT):
                g = first + p * self.groups_per_pass + lane // self.lanes
                rQ = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Float8E4M3FN)
                scale = quantize_group_fp8(rXs[p], rQ, self.lanes, self.ue8m0)
                if g < num_groups:
                    head, group = g // groups_per_head, g % groups_per_head
                    chunk = group * self.lanes + lane_in_group
                    cute.copy(store, rQ, cute.local_tile(mC[block, slot, head, None], (self.elems_per_lane,), (chunk,)))
                    if lane_in_group == 0:
                        mS[block, slot, head, group] = scale


def _fake_side(cdtype, head_dim: int, group_size: int, num_tokens, heads):
    states = fake_tensor(
        cdtype, (num_tokens, heads, head_dim),
        (cute.sym_int64(divisibility=128 // cdtype.width), cute.sym_int64(divisibility=128 // cdtype.width), 1),
    )  # fmt: skip
    blocks, block_size = cute.sym_int(), cute.sym_int()
    cache = fake_tensor(
        cutlass.Uint8, (blocks, block_size, heads, head_dim),
        (cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), cute.sym_int64(divisibility=16), 1),
    )  # fmt: skip
    scales = fake_tensor(
        cutlass.Float32, (blocks, block_size, heads, head_dim // group_size),
        tuple(cute.sym_int64() for _ in range(4)), align=4,
    )  # fmt: skip
    return states, cache, scales


@cached_compile
def compile_fill_kv_cache_fp8(
    dtype: torch.dtype, head_dim: int, head_dim_v, group_size: int, ue8m0: bool, arch: str, keep_cubin: bool = False
):
    """Compile for any token count, batch, cache size and layout; keyed on the scalars above."""
    cdtype = torch_to_cutlass_dtype(dtype)
    num_tokens, heads, batch = cute.sym_int(), cute.sym_int(), cute.sym_int()
    k_side = _fake_side(cdtype, head_dim, group_size, num_tokens, heads)
    v_side = (None, None, None) if head_dim_v is None else _fake_side(cdtype, head_dim_v, group_size, num_tokens, heads)
    cu = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
    kv_len = fake_tensor(cutlass.Int32, (batch,), (1,), align=4)
    block_offsets = fake_tensor(cutlass.Int32, (batch, cute.sym_int()), (cute.sym_int64(), 1), align=4)
    kernel = FillKvCacheFp8Kernel(cdtype, head_dim, head_dim_v, group_size, ue8m0)
    return compile_kernel(kernel, *k_side, *v_side, cu, kv_len, block_offsets, arch=arch, keep_cubin=keep_cubin)


def _as_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bhsd" else t


def _check_16b(name: str, t: torch.Tensor, dims) -> None:
    if t.data_ptr() % 16 or any((t.stride(d) * t.element_size()) % 16 for d in dims):
        raise ValueError(
            f"cute_moe.fill_kv_cache_fp8: {name} needs a 16-byte aligned base and strides that are "
            f"multiples of 16 bytes in dims {tuple(dims)}, got strides {tuple(t.stride())}"
        )


def _debug_check_block_ids(block_offsets: torch.Tensor, num_blocks: int) -> None:
    """CUTE_MOE_DEBUG=1: host check (a device sync) that every block id is in range or -1."""
    bad = (block_offsets >= num_blocks) | (block_offsets < -1)
    if bool(bad.any()):
        raise ValueError(
            f"cute_moe.fill_kv_cache_fp8: block_offsets holds ids outside [0, {num_blocks}) "
            f"(first at {tuple(bad.nonzero()[0].tolist())}); such slots would be skipped"
        )


def fill_kv_cache_fp8_cuda(
    k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache,
    cu_seqlens_q, kv_seqlens, block_offsets, group_size, scale_fmt, layout,
) -> None:  # fmt: skip
    """Launch on the states' device and current stream; inputs already validated by the op layer."""
    head_dim_v = None if v_states is None else v_states.shape[2]
    reason = FillKvCacheFp8Kernel.can_implement(k_states.dtype, k_states.shape[2], head_dim_v, group_size)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.fill_kv_cache_fp8: no CUDA kernel for this input: {reason}")
    sides = [("k", k_states, k_cache, k_scale_cache)]
    if v_states is not None:
        sides.append(("v", v_states, v_cache, v_scale_cache))
    args = []
    for name, states, cache, scales in sides:
        _check_16b(f"{name}_states", states, (0, 1))
        cache_bshd = _as_bshd(cache, layout)
        _check_16b(f"{name}_cache", cache_bshd, (0, 1, 2))
        args += [states, cache_bshd.view(torch.uint8), _as_bshd(scales, layout)]
    if v_states is None:
        args += [None, None, None]
    if os.environ.get("CUTE_MOE_DEBUG") == "1":
        _debug_check_block_ids(block_offsets, k_cache.shape[0])
    if k_states.shape[0] == 0 or cu_seqlens_q.shape[0] < 2:
        return
    fn = compile_fill_kv_cache_fp8(
        k_states.dtype, k_states.shape[2], head_dim_v, group_size, scale_fmt == "ue8m0", arch_of_device(k_states.device)
    )
    fn(*args, cu_seqlens_q, kv_seqlens, block_offsets)


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect fill_kv_cache_fp8``."""
    return [
        (
            f"fill_kv_cache_fp8[bfloat16, D={d}, Dv={dv}, group={g}, scale_fmt={fmt}]",
            compile_fill_kv_cache_fp8(torch.bfloat16, d, dv, g, fmt == "ue8m0", arch, True),
            0,
        )
        for d, dv, g, fmt in [(128, 128, 128, "none"), (128, 128, 128, "ue8m0"), (512, None, 128, "none")]
    ]
