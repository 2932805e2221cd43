"""lmdeploy-compatible weighted reduce (``cute_moe.moe_reduce``) as a CuTe DSL kernel.

Math, per token ``t`` and column ``h``, ``D`` being hidden's dtype (bf16, fp16, f32):

* ``fp32_acc=True`` (and always for f32 hidden): ``reference.moe_reduce_ref`` bit for bit::

      acc = 0.0f
      for j in 0..k-1:  acc = RN32(acc + RN32(w[t, j] * f32(hidden[t, j, h])))
      out[t, h] = D(acc)                                  # round to nearest even

  (a rounded product then a rounded sum, never an FMA: what ``acc + w * x`` computes
  as two torch kernels, on the CPU and on the GPU).
* ``fp32_acc=False`` with bf16/fp16 hidden: accumulation in ``D``, as lmdeploy's
  Triton kernel does (weights cast to ``D``, products and sums in ``D``)::

      wd = f32(D(w[t, j]));  acc = 0
      for j in 0..k-1:  acc = f32(D(RN32(acc + f32(D(RN32(wd * f32(hidden[t, j, h])))))))
      out[t, h] = D(acc)

  ``reference.moe_reduce_ref`` computes the same with torch's 16-bit arithmetic. This
  is ``D`` arithmetic done in f32: the product of two ``D`` values is exact in
  f32 (bar bf16 products below f32's normal range), and rounding an f32 sum again to
  ``D`` equals rounding the exact sum (f32 has at least ``2p + 2`` bits for ``D``'s
  ``p``).  lmdeploy sums the ``k`` products with ``tl.sum`` in an order Triton picks;
  this kernel sums in order ``j``, so it matches lmdeploy's rounding model, not its
  bits.

Mapping: as ``finalize`` (``reduce_common``): grid ``(T, slabs)``, a CTA of 128
threads per token and slab of ``128 * V`` 16-byte column vectors, the ``k``
weights read once per warp (lane ``j`` loads ``w[t, j]``) and shuffled, every row
load of a batch of up to 8 rows issued before any math, one 16-byte store per
vector.  Rows are ``hidden[t, j, :]`` directly (no indirection), so the row
loads depend on nothing and start at once.  The floor is HBM bandwidth: read
``k`` rows and the weights per token, write one row.

Constraints (``MoeReduceKernel.can_implement``): hidden bf16/fp16/f32 with unit
column stride and a 16-byte aligned base and strides; ``H`` a multiple of 16
bytes; ``1 <= k <= 32`` (``k == 0`` gives zeros without a launch).  ``T`` and
``H`` are dynamic; ``k``, the dtype and the accumulation mode are compiled in.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from .host_checks import check_rows_16b
from .reduce_common import (
    MAX_K,
    NUM_THREADS,
    check_slabs,
    opaque_zero,
    vectors_per_thread,
    warp_entries,
    weighted_row_sum,
)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MoeReduceKernel:
    """Static configuration: hidden's dtype, the top-k ``k`` and the accumulation mode."""

    num_threads = NUM_THREADS

    def __init__(self, dtype, k: int, fp32_acc: bool):
        self.dtype = dtype
        self.k = k
        # Accumulating in the row dtype is only different from f32 for 16-bit rows.
        self.round_to = None if fp32_acc or dtype.width == 32 else dtype
        self.elems = 128 // dtype.width  # elements in 16 bytes
        self.vecs = vectors_per_thread(k)
        self.cols_per_cta = self.cols_per_cta_for(dtype.width // 8, k)

    @classmethod
    def cols_per_cta_for(cls, elem_bytes: int, k: int) -> int:
        return cls.num_threads * vectors_per_thread(k) * (16 // elem_bytes)

    @staticmethod
    def can_implement(dtype: torch.dtype, k: int, hidden: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if dtype not in SUPPORTED_DTYPES:
            return f"hidden dtype must be one of {SUPPORTED_DTYPES}, got {dtype}"
        if not 1 <= k <= MAX_K:
            return f"k must be in [1, {MAX_K}], got {k}"
        elems = 16 // dtype.itemsize
        if hidden % elems:
            return f"H must be a multiple of {elems} for {dtype} (16-byte rows), got {hidden}"
        return None

    @cute.jit
    def __call__(self, mH: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mH, mW, mOut).launch(
            grid=[mH.shape[0], cute.ceil_div(mH.shape[2], self.cols_per_cta), 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, slab, _ = cute.arch.block_idx()
        weights = warp_entries(mW, token, self.k, Float32(0.0))
        if cutlass.const_expr(self.round_to is not None):
            weights = [w.to(self.round_to).to(Float32) for w in weights]  # lmdeploy: w.to(h.dtype)
        weighted_row_sum(
            [mH[token, j, None] for j in range(self.k)], [True] * self.k, weights, mOut[token, None],
            slab * (self.num_threads * self.vecs) + tidx, mH.shape[2] // self.elems, opaque_zero(mH.shape[0]),
            self.num_threads, self.vecs, self.round_to,
        )  # fmt: skip


@cached_compile
def compile_moe_reduce(dtype: torch.dtype, k: int, fp32_acc: bool, arch: str, keep_cubin: bool = False):
    """Compile for every T and H (and any strides); keyed on dtype, k, fp32_acc and the arch."""
    cdtype = torch_to_cutlass_dtype(dtype)
    elems = 128 // cdtype.width
    tokens, hidden = cute.sym_int(), cute.sym_int()
    mH = fake_tensor(
        cdtype, (tokens, k, hidden), (cute.sym_int64(divisibility=elems), cute.sym_int64(divisibility=elems), 1)
    )
    mW = fake_tensor(Float32, (tokens, k), (cute.sym_int64(), 1), align=4)
    mOut = fake_tensor(cdtype, (tokens, hidden), (cute.sym_int64(divisibility=elems), 1))
    return compile_kernel(MoeReduceKernel(cdtype, k, fp32_acc), mH, mW, mOut, arch=arch, keep_cubin=keep_cubin)


def moe_reduce_cuda(hidden: torch.Tensor, weights: torch.Tensor, fp32_acc: bool = False) -> torch.Tensor:
    """Launch on hidden's device and current stream; inputs already validated by the op layer."""
    T, k, H = hidden.shape
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    if T == 0 or H == 0:
        return out
    if k == 0:
        return out.zero_()
    reason = MoeReduceKernel.can_implement(hidden.dtype, k, H)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.moe_reduce: no CUDA kernel for this input: {reason}")
    check_rows_16b("moe_reduce", "hidden", hidden)
    check_slabs("moe_reduce", H, MoeReduceKernel.cols_per_cta_for(hidden.element_size(), k))
    # f32 rows: both modes are the same f32 accumulation; one compiled variant.
    fp32_acc = bool(fp32_acc) or hidden.dtype == torch.float32
    fn = compile_moe_reduce(hidden.dtype, k, fp32_acc, arch_of_device(hidden.device))
    fn(hidden, weights, out)
    return out


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for the SASS checks."""
    return [
        (
            f"moe_reduce[{str(dtype).removeprefix('torch.')}, k={k}, fp32_acc={acc}]",
            compile_moe_reduce(dtype, k, acc, arch, True),
            0,
        )
        for dtype, k, acc in [
            (torch.bfloat16, 8, True),
            (torch.bfloat16, 8, False),
            (torch.float16, 2, False),
            (torch.float32, 6, True),
        ]
    ]
