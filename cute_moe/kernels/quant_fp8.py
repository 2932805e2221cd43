"""Per-token-group FP8 quantization (``cute_moe.quant_fp8``) as a CuTe DSL kernel.

Math, per row ``r`` and group ``g`` of ``G`` consecutive columns: the contract's
formula, implemented once in ``fp8_group.quantize_group_fp8`` (amax floored at
1e-6, scale = amax/448 or its ue8m0 rounding, codes = e4m3(clamp(x/scale))),
bit-identical to ``reference.quant_fp8_ref``.

Mapping: one (row, group) is handled by ``T = min(32, G / v)`` consecutive lanes
of a warp, ``v`` being the elements in 16 bytes of input (8 for bf16/fp16, 4 for
f32); each lane loads its ``G / T`` contiguous elements with 128-bit loads, the
group's amax is a butterfly shuffle reduction over those ``T`` lanes, and each
lane stores its codes with one vector store.  Each thread handles 4 rows, with
all 4 loads issued before any math so that enough bytes are in flight; a CTA of
256 threads covers ``4 * 256 / T`` rows of one group column, and the grid is
(K / G, row blocks).  There is no shared memory and no inter-CTA communication:
the kernel is one read of x and one write of q and the scales, so its floor is
HBM bandwidth.

Constraints (``QuantFp8Kernel.can_implement``): x is bf16, fp16 or f32 with unit
column stride, 16-byte aligned base and row stride; G is a power of two in
[32, 1024]; K % G == 0; at most 65535 blocks of rows (a ValueError above: ~4.2M
rows of bf16 at G = 128).  The scale tensor may have any strides (row- or
column-major); the codes tensor is contiguous.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32

from ..compiler import (
    arch_of_device,
    cached_compile,
    compile_kernel,
    fake_tensor,
    torch_to_cutlass_dtype,
)
from .fp8_group import lanes_per_group, quantize_group_fp8
from .host_checks import MAX_GRID_Y, check_rows_16b, empty_mn_major

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantFp8Kernel:
    """Static configuration: input dtype, group size, scale format, CTA shape."""

    num_threads = 256
    rows_per_thread = 4

    def __init__(self, dtype, group_size: int, ue8m0: bool):
        self.dtype = dtype
        self.group_size = group_size
        self.ue8m0 = ue8m0
        self.threads_per_group = lanes_per_group(dtype.width // 8, group_size)
        self.elems_per_thread = group_size // self.threads_per_group
        self.rows_per_pass = self.num_threads // self.threads_per_group
        self.rows_per_cta = self.rows_per_pass * self.rows_per_thread

    @classmethod
    def rows_per_cta_for(cls, elem_bytes: int, group_size: int) -> int:
        return cls.num_threads // lanes_per_group(elem_bytes, group_size) * cls.rows_per_thread

    @staticmethod
    def can_implement(dtype: torch.dtype, group_size: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if dtype not in SUPPORTED_DTYPES:
            return f"x dtype must be one of {SUPPORTED_DTYPES}, got {dtype}"
        if group_size < 32 or group_size > 1024 or group_size & (group_size - 1):
            return f"group_size must be a power of two in [32, 1024], got {group_size}"
        return None

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        # Codes travel as uint8 through TVM-FFI (DLPack float8 support varies by torch version).
        mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Float8E4M3FN), mQ.layout)
        # Group columns vary fastest across CTAs, so neighbouring CTAs read neighbouring bytes.
        self.kernel(mX, mQ, mS).launch(
            grid=[mX.shape[1] // self.group_size, cute.ceil_div(mX.shape[0], self.rows_per_cta), 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        group, bidy, _ = cute.arch.block_idx()
        first_row = bidy * self.rows_per_cta + tidx // self.threads_per_group
        chunk = group * self.threads_per_group + tidx % self.threads_per_group
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        store = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=min(128, 8 * self.elems_per_thread)
        )

        # All loads first, so rows_per_thread 16-byte loads per thread are in flight at once.
        # Rows past M re-read row M-1 (no predicated loads, no zero fill): every lane then
        # joins the shuffles (full-warp shfl.sync), and only the stores are predicated.
        rXs = []
        for u in cutlass.range_constexpr(self.rows_per_thread):
            row = cutlass.min(first_row + u * self.rows_per_pass, mX.shape[0] - 1)
            rX = cute.make_rmem_tensor((self.elems_per_thread,), self.dtype)
            cute.copy(load, cute.local_tile(mX[row, None], (self.elems_per_thread,), (chunk,)), rX)
            rXs.append(rX)

        for u in cutlass.range_constexpr(self.rows_per_thread):
            row = first_row + u * self.rows_per_pass
            rQ = cute.make_rmem_tensor((self.elems_per_thread,), cutlass.Float8E4M3FN)
            scale = quantize_group_fp8(rXs[u], rQ, self.threads_per_group, self.ue8m0)
            if row < mX.shape[0]:
                cute.copy(store, rQ, cute.local_tile(mQ[row, None], (self.elems_per_thread,), (chunk,)))
                if tidx % self.threads_per_group == 0:
                    mS[row, group] = scale


@cached_compile
def compile_quant_fp8(dtype: torch.dtype, group_size: int, ue8m0: bool, arch: str, keep_cubin: bool = False):
    """Compile for every M, K and scale layout; the key is the scalars above."""
    cdtype = torch_to_cutlass_dtype(dtype)
    m, k, k_groups = cute.sym_int(), cute.sym_int(), cute.sym_int()
    mX = fake_tensor(cdtype, (m, k), (cute.sym_int64(divisibility=128 // cdtype.width), 1))
    mQ = fake_tensor(cutlass.Uint8, (m, k), (cute.sym_int64(divisibility=16), 1))
    mS = fake_tensor(Float32, (m, k_groups), (cute.sym_int64(), cute.sym_int64()), align=4)
    return compile_kernel(QuantFp8Kernel(cdtype, group_size, ue8m0), mX, mQ, mS, arch=arch, keep_cubin=keep_cubin)


def quant_fp8_cuda(x: torch.Tensor, group_size: int, scale_fmt: str | None, column_major_scales: bool):
    """Launch on x's device and current stream; x is already validated by the op layer."""
    reason = QuantFp8Kernel.can_implement(x.dtype, group_size)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.quant_fp8: no CUDA kernel for this input: {reason}")
    check_rows_16b("quant_fp8", "x", x)
    m, k = x.shape
    row_blocks = -(-m // QuantFp8Kernel.rows_per_cta_for(x.element_size(), group_size))
    if row_blocks > MAX_GRID_Y:
        raise ValueError(f"cute_moe.quant_fp8: x has {m} rows; this kernel handles at most {MAX_GRID_Y} row blocks")
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if column_major_scales:
        scale = empty_mn_major(m, k // group_size, x.device)
    else:
        scale = torch.empty(m, k // group_size, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    fn = compile_quant_fp8(x.dtype, group_size, scale_fmt == "ue8m0", arch_of_device(x.device))
    fn(x, q.view(torch.uint8), scale)
    return q, scale


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect quant_fp8``."""
    return [
        (
            f"quant_fp8[{str(dtype).removeprefix('torch.')}, group={group}, scale_fmt={fmt}]",
            compile_quant_fp8(dtype, group, fmt == "ue8m0", arch, True),
            0,
        )
        for dtype, group, fmt in [
            (torch.bfloat16, 128, "none"),
            (torch.bfloat16, 128, "ue8m0"),
            (torch.float32, 128, "none"),
        ]
    ]
