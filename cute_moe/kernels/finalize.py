"""Weighted un-permute (``cute_moe.finalize``) as a CuTe DSL kernel.

Math, per token ``t`` and column ``h`` (``reference.finalize_ref``, bit for bit)::

    acc = 0.0f
    for j in 0..k-1:                       # in order
        r = token_to_row[t, j]
        if 0 <= r < M_cap:                 # -1 (and anything out of range) is skipped:
            acc = acc + w[t, j] * f32(y[r, h])   # its weight is never used, NaN or not
    out[t, h] = bf16(acc)                  # round to nearest even

The product and the sum are separately rounded f32 operations (``mul.rn`` then
``add.rn``, never contracted into an FMA), which is what the reference computes
on the CPU and on the GPU (``acc + w * y`` is two torch kernels there), so the
output is bit-identical.  No atomics: each output element is written by one
thread, so the result is deterministic.

Mapping (shared with ``moe_reduce``, in ``reduce_common``): grid ``(T, slabs)``;
a CTA of 128 threads handles one token and one slab of ``128 * V`` 16-byte
column vectors (``1024 * V`` columns), ``V = max(1, 4 // k)`` vectors per thread
per row.  Each warp reads the token's ``k`` indices and weights once (lane ``j``
loads entry ``j``: two coalesced loads) and broadcasts them with shuffles.  Each
thread then issues all its row loads -- ``V`` vectors of each of the ``k`` rows,
16 bytes each, predicated on the row being valid (a skipped row is never
dereferenced) -- before any math, accumulates in order ``j`` and stores ``V``
16-byte vectors of ``out``.  For ``k > 8`` the rows go in batches of 8 (all
loads of a batch, then its math).  Two details keep the loads in flight (see
``reduce_common``): the loads are predicated ``ld.global.v4`` in inline PTX
rather than a copy under a branch, and every weight of a batch is made to
depend on every load of the batch (an OR with an opaque zero), otherwise ptxas
sinks the loads between the rows' math to fit in 32 registers and keeps only
two in flight.  With ``k = 8``: eight 16-byte loads in flight per thread, 56
registers, 9 CTAs (1152 threads, about 144 KB of loads) per SM.  No shared
memory, no synchronisation: the floor is HBM bandwidth (read ``k`` rows of
``y`` plus ``k`` indices and weights per token, write one row of ``out``).

Constraints (``FinalizeKernel.can_implement`` and the launch function): y bf16
with unit column stride and a 16-byte aligned base and row stride; ``H % 8 ==
0``; ``1 <= k <= 32`` (``k == 0`` gives zeros without a launch).  ``T``, ``H``
and ``M_cap`` are dynamic; only ``k`` is compiled in.  Rows outside ``[0,
M_cap)`` are skipped rather than read (``CUTE_MOE_DEBUG=1`` makes the op check
on the host and raise instead).
"""

from __future__ import annotations


import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor
from .host_checks import check_rows_16b, debug_check_index_range
from .reduce_common import (
    MAX_K,
    NUM_THREADS,
    check_slabs,
    opaque_zero,
    vectors_per_thread,
    warp_entries,
    weighted_row_sum,
)

_VEC = 8  # bf16 elements in 16 bytes


class FinalizeKernel:
    """Static configuration: the top-k ``k`` (entries per token)."""

    num_threads = NUM_THREADS

    def __init__(self, k: int):
        self.k = k
        self.vecs = vectors_per_thread(k)  # V: 16-byte column vectors per thread per row
        self.cols_per_cta = self.cols_per_cta_for(k)

    @classmethod
    def cols_per_cta_for(cls, k: int) -> int:
        return cls.num_threads * vectors_per_thread(k) * _VEC

    @staticmethod
    def can_implement(k: int, hidden: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if not 1 <= k <= MAX_K:
            return f"k must be in [1, {MAX_K}], got {k}"
        if hidden % _VEC:
            return f"H must be a multiple of {_VEC} (16-byte rows), got {hidden}"
        return None

    @cute.jit
    def __call__(self, mY: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor, stream):
        # Tokens on x (up to 2**31 - 1 CTAs), column slabs on y.
        self.kernel(mY, mW, mIdx, mOut).launch(
            grid=[mW.shape[0], cute.ceil_div(mY.shape[1], self.cols_per_cta), 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mW: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, slab, _ = cute.arch.block_idx()
        num_rows = mY.shape[0]

        rows = warp_entries(mIdx, token, self.k, Int32(-1))
        weights = warp_entries(mW, token, self.k, Float32(0.0))
        valid = [(rows[j] >= 0) & (rows[j] < num_rows) for j in range(self.k)]
        # A skipped entry reads as a zero row and gets weight +0: its product is +0 and
        # acc + 0 == acc exactly (acc starts at +0, so it is never -0), whatever its real
        # weight is (NaN included); its row is never dereferenced (row 0 is only an address).
        weights = [cutlass.select_(valid[j], weights[j], Float32(0.0)) for j in range(self.k)]
        row_views = [mY[cutlass.select_(valid[j], rows[j], Int32(0)), None] for j in range(self.k)]
        weighted_row_sum(
            row_views, valid, weights, mOut[token, None],
            slab * (self.num_threads * self.vecs) + tidx, mY.shape[1] // _VEC, opaque_zero(num_rows),
            self.num_threads, self.vecs, None,
        )  # fmt: skip


@cached_compile
def compile_finalize(k: int, arch: str, keep_cubin: bool = False):
    """Compile for every T, H and M_cap (and any row strides); the key is k and the arch."""
    tokens, hidden = cute.sym_int(), cute.sym_int()
    mY = fake_tensor(cutlass.BFloat16, (cute.sym_int(), hidden), (cute.sym_int64(divisibility=_VEC), 1))
    mW = fake_tensor(Float32, (tokens, k), (cute.sym_int64(), 1), align=4)
    mIdx = fake_tensor(Int32, (tokens, k), (cute.sym_int64(), 1), align=4)
    mOut = fake_tensor(cutlass.BFloat16, (tokens, hidden), (cute.sym_int64(divisibility=_VEC), 1))
    return compile_kernel(FinalizeKernel(k), mY, mW, mIdx, mOut, arch=arch, keep_cubin=keep_cubin)


def finalize_cuda(y: torch.Tensor, topk_weights: torch.Tensor, token_to_row: torch.Tensor) -> torch.Tensor:
    """Launch on y's device and current stream; inputs already validated by the op layer."""
    T, k = topk_weights.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=torch.bfloat16, device=y.device)
    if T == 0 or H == 0:
        return out
    if k == 0:
        return out.zero_()
    reason = FinalizeKernel.can_implement(k, H)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.finalize: no CUDA kernel for this input: {reason}")
    check_rows_16b("finalize", "y", y)
    check_slabs("finalize", H, FinalizeKernel.cols_per_cta_for(k))
    debug_check_index_range("finalize", "token_to_row", token_to_row, y.shape[0])
    if y.shape[0] == 0:  # no row to read: every entry is skipped
        return out.zero_()
    fn = compile_finalize(k, arch_of_device(y.device))
    fn(y, topk_weights, token_to_row, out)
    return out


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for the SASS checks."""
    return [(f"finalize[bfloat16, k={k}]", compile_finalize(k, arch, True), 0) for k in (8, 1, 6, 16)]
