"""SwiGLU then FP8 re-quantization (``cute_moe.silu_mul_quant``) as a CuTe DSL kernel.

Math, per row ``r < end = expert_offsets[-1]`` (read on the device) and column
``c < I``, with ``gate`` / ``up`` the two halves of ``h[r]`` (``gate_first`` picks
the order; the host passes the two halves as strided views, so the kernel never
sees the flag):

    y = f32(silu(gate) * up),  silu(g) = g / (1 + expf(-g))    (all in f32)

then ``a2[r], scale[r] = quant(y)`` per group of 128 columns with the contract's
formula (``fp8_group.quantize_group_fp8``).  Rows ``r >= end`` are neither read
nor written.  Scales are written MN-major (``scale[r, g]`` at ``g * M_cap + r``).

Numerics, bit for bit with the reference on CUDA (``F.silu(gate.float()) * up``):

* torch computes silu in f32 as ``x / (1 + ::expf(-x))``, compiled without fast
  math.  nvcc inlines libdevice's ``expf`` and contracts its final scaling
  multiply with the ``1 +`` into one FMA, so the denominator is
  ``d = fma(ex2.approx.ftz(t), 2**i, 1)`` with ``t``, ``i`` from libdevice's
  range reduction.  ``ONE_PLUS_EXP_NEG`` is that PTX sequence, instruction for
  instruction (read off ``nvcc -arch=sm_90a -ptx`` of the same expression; its
  SASS is the FFMA.SAT / FFMA.RM / MUFU.EX2 / FFMA sequence of torch's kernel).
* ``g / d`` is IEEE division (``div.rn.f32``), which ptxas expands into a fast
  path (MUFU.RCP, one Newton step, quotient, one FMA residual correction) and a
  slow path taken when FCHK flags the operands (zero or subnormal numerator,
  exponents out of range).  The kernel runs the fast path's instruction
  sequence alone, so wherever torch takes the fast path the two agree bit for
  bit (same MUFU.RCP, same FMAs).  Where FCHK would divert torch, the fast path
  is still exact here, for every ``d <= 2**126``: a zero or tiny numerator
  (``|g| < 2**-25``) comes with ``d == 2`` exactly, where the refined reciprocal
  is 0.5 and the result RN(g / 2); otherwise every intermediate stays normal, and the sequence is an
  exact power-of-two scaling of an in-range division.  The residual is taken
  negated (``d*q - g``) so that ``g = -0.0`` keeps its sign, as the slow path
  does.  For ``d > 2**126`` (``g < -87.34``; ``d`` is clamped from +inf to
  FLT_MAX) the reciprocal flushes to zero and the kernel yields a zero with the
  sign of ``g`` instead of the true ``|silu(g)| < 1.1e-36``.
* ``silu * up`` is one f32 multiply, as torch's separate ``mul``.

So ``y`` is bit-identical to the reference's except for ``-88.72 < g < -87.34``,
where the kernel's ``y`` is a zero of the reference's sign instead of a value of
magnitude below ``1.1e-36 * |up|`` (below -88.72 torch divides by +inf and gets
the same signed zero).  Codes and scales are still identical there
for any ``|up| < 2e24``: such a value is below the 1e-6 amax floor, so it never
sets the scale, and divided by any scale (>= 1e-6 / 448) it rounds to an FP8
zero of the same sign.  The quantizer is the one ``quant_fp8`` uses (``y = -0.0``
gives code 0x80, like the reference's true division).

Mapping (as in ``quant_fp8``): one (row, group of 128 outputs) is handled by
16 consecutive lanes, each owning 8 outputs, i.e. 16 bytes of gate and 16 bytes
of up; a CTA of 256 threads covers 16 rows per pass and 4 passes (64 rows of one
group column); the grid is ``(I / 128, ceil(M_cap / 64))``, group columns
fastest, with a grid-stride loop past 65535 row blocks.  Each thread issues its
8 loads of 16 bytes (128 bytes) as ``cp.async`` into per-thread shared-memory
slots (32 KB per CTA), waits once, then computes row by row from its slots:
with plain loads ptxas interleaves the loads with the ~25 instructions of math
per element (seen in the SASS), and the data would occupy 32 more registers.
Loads of rows at or past ``end`` are skipped (those rows compute on stale slots
and store nothing), and CTAs whose rows all lie past ``end`` exit at once.

With ``expert_counts`` (``align``'s fourth output: real rows per segment; the
``has_counts`` variant), rows of segment e at or past ``off[e] + counts[e]`` are
padding and skipped entirely: no load of h, no store of codes or scales (their
content is unspecified), so the traffic is the routed rows only (DeepSeek-V3
shape, E=256, top-8: 11% fewer bytes at T=16384, 31% at T=4096, 75% at T=1024,
97% at T=128, where nearly every segment is one 128-row tile of a few rows). A
CTA's 64 rows divide 128, so with segments of multiples of 128 rows
(``align(..., alignment=128)``, as the GEMM needs) they lie in one segment:
every warp finds it and its end of real rows itself (``moe_rows.real_rows_end``:
three loads per segment, 8 segments per lane, all issued before the first
compare, then a warp max; no barrier), before issuing its loads. A block of pure
padding then does nothing more; in a partial block the padding rows are treated
like rows past ``end`` (predicated loads and stores). A block that straddles
segment ends (a routing aligned to fewer than 64 rows) processes every row below
``end``, as without counts: never a wrong real row, whatever the alignment.
SASS of this variant (sm_90a): 35 registers, 24 lookup loads then 5 + 1
shuffles before the first ``cp.async``; ptxas leaves the ``.LTC128B`` L2
prefetch hint off its row loads (it does so whenever the kernel holds the
lookup's loop), which should not matter: each warp's 16-byte loads cover whole
128-byte lines.

Constraints (``can_implement``): h bf16 or fp16 with unit column stride, a
16-byte aligned base and row stride (checked on the host); I a multiple of 128.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from .fp8_group import to_f32
from .moe_rows import GROUP, RowGroupKernel, checked_outputs, real_rows_end

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

# 1 + expf(-x) exactly as nvcc compiles torch's `opmath_t(1) + ::expf(-x_acc)` (libdevice expf,
# its final multiply contracted with the add).
ONE_PLUS_EXP_NEG = """{
.reg .f32 sm_n, sm_t, sm_j, sm_r, sm_s, sm_e;
.reg .b32 sm_b;
neg.f32 sm_n, {$r0};
fma.rn.f32 sm_t, sm_n, 0f3BBB989D, 0f3F000000;
cvt.sat.f32.f32 sm_t, sm_t;
fma.rm.f32 sm_j, sm_t, 0f437C0000, 0f4B400001;
add.rn.f32 sm_r, sm_j, 0fCB40007F;
neg.f32 sm_r, sm_r;
fma.rn.f32 sm_r, sm_n, 0f3FB8AA3B, sm_r;
fma.rn.f32 sm_r, sm_n, 0f32A57060, sm_r;
mov.b32 sm_b, sm_j;
shl.b32 sm_b, sm_b, 23;
mov.b32 sm_s, sm_b;
ex2.approx.ftz.f32 sm_e, sm_r;
fma.rn.f32 {$w0}, sm_e, sm_s, 0f3F800000;
}"""
F32_MAX = 3.4028234663852886e38


@cute.jit
def _silu(g: Float32) -> Float32:
    """g / (1 + expf(-g)) in f32 as torch computes it on CUDA (see the module docstring): the
    denominator by libdevice's expf sequence, the quotient by div.rn.f32's fast path with the
    residual negated (keeps the sign of g = -0.0); for d > 2**126 a zero with the sign of g."""
    d = cute.arch.inline_ptx(ONE_PLUS_EXP_NEG, write_only_types=[Float32], read_only_args=[g])
    d = cute.arch.fmin(d, Float32(F32_MAX))
    r = cute.arch.rcp_approx(d)
    y = cute.math.fma(cute.math.fma(-d, r, Float32(1.0)), r, r)
    q = g * y
    return cute.math.fma(-cute.math.fma(d, q, -g), y, q)


@cute.jit
def silu_mul(rG: cute.Tensor, rU: cute.Tensor, rY: cute.Tensor):
    """rY = f32(silu(rG) * rU) elementwise in registers (one f32 multiply, as torch's mul)."""
    g, u = to_f32(rG), to_f32(rU)  # bf16: one shift or mask per value
    for i in cutlass.range_constexpr(cute.size(rY)):
        rY[i] = _silu(g[i]) * u[i]


class SiluMulQuantKernel(RowGroupKernel):
    """Static configuration: input dtype, scale format, and whether the launch passes
    ``expert_counts`` (real rows per segment; the rest of a segment is padding, skipped)."""

    def __init__(self, dtype, ue8m0: bool, has_counts: bool = False):
        super().__init__(dtype.width // 8)
        self.dtype = dtype
        self.ue8m0 = ue8m0
        self.has_counts = has_counts

    def smem_bytes(self) -> int:
        return 2 * 16 * self.num_threads * self.rows_per_thread

    @staticmethod
    def can_implement(dtype: torch.dtype, inter: int) -> str | None:
        """None when the kernel supports the configuration, else the reason."""
        if dtype not in SUPPORTED_DTYPES:
            return f"h dtype must be one of {SUPPORTED_DTYPES}, got {dtype}"
        if inter % GROUP:
            return f"I = h.shape[1] / 2 must be a multiple of {GROUP}, got {inter}"
        return None

    @cute.jit
    def __call__(self, mG, mU, mOff, mCnt, mQ, mS, stream):
        mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=cutlass.Float8E4M3FN), mQ.layout)
        self.kernel(mG, mU, mOff, mCnt, mQ, mS).launch(
            grid=self.grid(mQ), block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mU: cute.Tensor, mOff: cute.Tensor, mCnt: cute.Tensor, mQ: cute.Tensor,
               mS: cute.Tensor):  # fmt: skip
        tidx, group, bidy, grid_y, end, chunk = self.coords(mOff, mQ)
        # cp.async into per-thread slots of shared memory (slot 2u: gate of row u, 2u + 1: up):
        # all 8 loads are issued back to back, and none of the math can be scheduled between them.
        g2s = self.load_16b_async(self.dtype)
        slots = self.thread_slots(2 * self.rows_per_thread)
        sIn = cutlass.utils.SmemAllocator().allocate_tensor(self.dtype, slots, byte_alignment=16)
        for block in range(bidy, cute.ceil_div(end, self.rows_per_cta), grid_y):
            if cutlass.const_expr(self.has_counts):
                # Every warp finds the real rows of the block's segment itself (no barrier); a
                # block of pure padding does nothing more, a partial one skips its padding rows.
                block_row = block * self.rows_per_cta
                last_row = min(block_row + self.rows_per_cta, end) - 1
                limit = cute.arch.make_warp_uniform(real_rows_end(mOff, mCnt, block_row, last_row, end))
                if block_row < limit:
                    self.block_rows(mG, mU, mQ, mS, sIn, g2s, block, limit, group, chunk, tidx)
            else:
                self.block_rows(mG, mU, mQ, mS, sIn, g2s, block, end, group, chunk, tidx)

    @cute.jit
    def block_rows(self, mG: cute.Tensor, mU: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, sIn: cute.Tensor, g2s,
                   block: Int32, limit: Int32, group: Int32, chunk: Int32, tidx: Int32):  # fmt: skip
        """The CTA's rows of one block: rows below ``limit`` are loaded, computed and stored."""
        first_row = block * self.rows_per_cta + tidx // self.lanes
        for u in cutlass.range_constexpr(self.rows_per_thread):
            row = first_row + u * self.rows_per_pass
            if row < limit:
                for half, mIn in enumerate((mG, mU)):
                    src = cute.local_tile(mIn[row, None], (self.elems_per_lane,), (chunk,))
                    cute.copy(g2s, src, sIn[None, tidx, 2 * u + half])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        for u in cutlass.range_constexpr(self.rows_per_thread):
            # A row at or past limit computes on stale slots: its lanes still join the quantizer's
            # shuffles (which stay within the row's lanes), and nothing of it is stored.
            rG = cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
            rU = cute.make_rmem_tensor((self.elems_per_lane,), self.dtype)
            cute.autovec_copy(sIn[None, tidx, 2 * u], rG)
            cute.autovec_copy(sIn[None, tidx, 2 * u + 1], rU)
            rY = cute.make_rmem_tensor((self.elems_per_lane,), Float32)
            silu_mul(rG, rU, rY)
            self.quantize_store(rY, mQ, mS, first_row + u * self.rows_per_pass, limit, group, chunk, tidx, self.ue8m0)


@cached_compile
def compile_silu_mul_quant(dtype: torch.dtype, ue8m0: bool, arch: str, keep_cubin: bool = False,
                           has_counts: bool = False):  # fmt: skip
    """Compile for every M_cap, I, E and scale layout; the key is the scalars above."""
    cdtype = torch_to_cutlass_dtype(dtype)
    m, inter = cute.sym_int(), cute.sym_int()
    row_stride = cute.sym_int64(divisibility=128 // cdtype.width)
    mG = fake_tensor(cdtype, (m, inter), (row_stride, 1))
    mU = fake_tensor(cdtype, (m, inter), (row_stride, 1))
    mOff = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
    mCnt = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)  # expert_counts, or offsets when unused
    mQ = fake_tensor(cutlass.Uint8, (m, inter), (cute.sym_int64(divisibility=16), 1))
    mS = fake_tensor(Float32, (m, cute.sym_int()), (cute.sym_int64(), cute.sym_int64()), align=4)
    kernel = SiluMulQuantKernel(cdtype, ue8m0, has_counts)
    return compile_kernel(kernel, mG, mU, mOff, mCnt, mQ, mS, arch=arch, keep_cubin=keep_cubin)


def silu_mul_quant_cuda(h: torch.Tensor, expert_offsets: torch.Tensor, gate_first: bool = True, scale_fmt=None,
                        expert_counts: torch.Tensor | None = None):  # fmt: skip
    """Launch on h's device and current stream; inputs already validated by the op layer.

    ``expert_counts`` (optional, int32 [E]): real rows per segment (``align``'s fourth output);
    rows of segment e at or past ``off[e] + counts[e]`` are then neither read nor written (their
    codes and scales are unspecified)."""
    m_cap, inter = h.shape[0], h.shape[1] // 2
    reason = SiluMulQuantKernel.can_implement(h.dtype, inter)
    a2, scale = checked_outputs("silu_mul_quant", "h", h, reason, m_cap, inter)
    if a2.numel() == 0:
        return a2, scale
    first, second = h[:, :inter], h[:, inter:]
    gate, up = (first, second) if gate_first else (second, first)
    has_counts = expert_counts is not None
    fn = compile_silu_mul_quant(h.dtype, scale_fmt == "ue8m0", arch_of_device(h.device), False, has_counts)
    fn(gate, up, expert_offsets, expert_counts if has_counts else expert_offsets, a2.view(torch.uint8), scale)
    return a2, scale


def inspect_variants(arch: str):
    """(name, compiled function, dynamic smem bytes) for ``python -m cute_moe.inspect silu_mul_quant``."""
    smem = SiluMulQuantKernel(torch_to_cutlass_dtype(torch.bfloat16), False).smem_bytes()
    return [
        (
            f"silu_mul_quant[bfloat16, scale_fmt={fmt}{', expert_counts' if counts else ''}]",
            compile_silu_mul_quant(torch.bfloat16, fmt == "ue8m0", arch, True, counts),
            smem,
        )
        for counts in (False, True)
        for fmt in ("none", "ue8m0")
    ]
