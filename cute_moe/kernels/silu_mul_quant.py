"""SwiGLU then FP8 re-quantization (``cute_moe.silu_mul_quant``) as a CuTe DSL kernel.

Math, per row ``r < end = expert_offsets[-1]`` (read on the device) and column
``c < I``, with ``gate`` / ``up`` the two halves of ``h[r]`` (``gate_first`` picks
the order; the host passes the two halves as strided views, so the kernel never
sees the flag):

    y = f32(silu(gate) * up),  silu(g) = g / (1 + expf(-g))    (all in f32)

then ``a2[r], scale[r] = quant(y)`` per group of 128 columns with the contract's
formula (``fp8_group.quantize_group_fp8``).  Rows ``r >= end`` are neither read
nor written.  Scales are written MN-major (``scale[r, g]`` at ``g * M_cap + r``).

Numerics of ``y``, bit for bit with the reference on CUDA (``F.silu(gate.float()) * up``):

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
zero of the same sign.

The quantizer is ``quant_fp8``'s with ``correctly_rounded=False`` (see
``fp8_group``): the scale is the contract's, bit for bit (it comes from the
bit-exact group max), but ``y / scale`` is taken as ``y * (1/scale)``, one
multiply per element instead of three instructions.  The product is within an
f32 ulp or two of ``RN(y / scale)`` (one when the refined reciprocal is
``RN(1/scale)``, as it was in every group tried), so a code can only move to the
neighbouring e4m3 value, where the quotient lies that close to an e4m3 rounding
midpoint.
CPU emulation (y from bf16 data, 8.4e7 elements each): 6e-7 of the codes
differ for N(0, 1) inputs, 2.5e-6 with magnitudes over six decades, most of
them exact ties of ``y / scale`` (bf16 products make short quotients); the
contract allows 1e-4.  ``y = -0.0`` gives code 0x80, like the reference's
division.

Mapping: one (row, group of 128 outputs) is handled by 8 consecutive lanes,
lane l owning the 16 outputs of columns ``[8l, 8l + 8)`` and ``[64 + 8l, 72 +
8l)`` of the group, i.e. two 16-byte pieces of gate and two of up, so that each
16-byte load instruction of a warp covers whole 128-byte lines (and each 8-byte
code store whole 32-byte sectors).  Sixteen outputs per lane halve the per-row
costs per output against 8 per lane: the amax butterfly (3 shuffle steps), the
scale and its reciprocal, the stores.  A CTA of 256 threads covers 32 rows per
pass and 2 passes (64 rows of one group column).  The grid is ``(I / 128,
min(blocks, 65535), ceil(blocks / 65535))`` for ``blocks = ceil(M_cap / 64)``,
group columns fastest, one block of 64 rows per CTA and no loop (a grid-stride
loop made ptxas keep the loads' per-thread addresses live through the math:
44 registers, 5 CTAs per SM).  Each thread issues its 8 loads of 16 bytes
(128 bytes) as ``cp.async`` into per-thread shared-memory slots (32 KB per
CTA), waits once, then computes row by row from its slots: with plain loads
ptxas interleaves the loads with the ~20 instructions of math per element, and
the data would occupy 32 more registers.  The addresses of a thread's loads and
stores are one base per tensor plus immediates and multiples of the row stride.
Loads of rows at or past ``end`` are skipped (those rows compute on stale slots
and store nothing), and CTAs whose rows all lie past ``end`` exit at once.

With ``expert_counts`` (``align``'s fourth output: real rows per segment; the
``has_counts`` variant), rows of segment e at or past ``off[e] + counts[e]`` are
padding and skipped entirely: no load of h, no store of codes or scales (their
content is unspecified), so the traffic is the routed rows only (DeepSeek-V3
shape, E=256, top-8: 11% fewer bytes at T=16384, 31% at T=4096, 75% at T=1024,
97% at T=128, where nearly every segment is one 128-row tile of a few rows). A
CTA's 64 rows divide 128, so with segments of multiples of 128 rows
(``align(..., alignment=128)``, as the GEMM needs) they lie in one segment; the
CTA finds it and its end of real rows before issuing its loads
(``moe_rows.real_rows_end``: one segment per thread, three loads issued
together, a ``redux.sync`` per warp, one barrier). A block of pure
padding then does nothing more; in a partial block the padding rows are treated
like rows past ``end`` (predicated loads and stores). A block that straddles
segment ends (a routing aligned to fewer than 64 rows) processes every row below
``end``, as without counts: never a wrong real row, whatever the alignment.

SASS (sm_90a, per thread, i.e. per 32 outputs): 798 instructions without
counts, 846 with (the kernel with 16 lanes per row, the exact quotient, a
grid-stride loop and a per-warp lookup: 1025 and 1224); 40 and 32 registers
(at most 40 for 6 CTAs per SM, the most that shared memory allows), no spills.
The math is ~20 instructions per output: 8 for ``expf``, 7 for the division
(with the clamp), 2 to widen bf16, the ``up`` multiply, the amax step, the
quotient and half a conversion.

Constraints (``can_implement``): h bf16 (the GEMM's output; the op takes bf16 only) with unit
column stride, a 16-byte aligned base and row stride (checked on the host); I a multiple of 128.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from .fp8_group import quantize_group_fp8, to_f32
from .moe_rows import GROUP, MAX_GRID_Y, checked_outputs, load_16b_async, real_rows_end, rows_end, thread_slots

SUPPORTED_DTYPES = (torch.bfloat16,)

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


class SiluMulQuantKernel:
    """Static configuration: input dtype, scale format, and whether the launch passes
    ``expert_counts`` (real rows per segment; the rest of a segment is padding, skipped).
    CTA shape in the module docstring ("Mapping")."""

    num_threads = 256
    lanes = 8  # per (row, group)
    pieces = 2  # 16-byte pieces of gate (and of up) per lane and row
    rows_per_thread = 2

    def __init__(self, dtype, ue8m0: bool, has_counts: bool = False):
        self.dtype = dtype
        self.ue8m0 = ue8m0
        self.has_counts = has_counts
        self.piece_elems = 128 // dtype.width
        self.elems_per_lane = self.pieces * self.piece_elems
        assert self.lanes * self.elems_per_lane == GROUP
        self.rows_per_pass = self.num_threads // self.lanes
        self.rows_per_cta = self.rows_per_pass * self.rows_per_thread
        self.slots = 2 * self.rows_per_thread * self.pieces  # 16-byte shared-memory slots per thread

    def smem_bytes(self) -> int:
        """Input slots, then one word per warp for ``real_rows_end`` (unused without counts)."""
        return 16 * self.num_threads * self.slots + 4 * (self.num_threads // 32)

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

    @cute.jit
    def grid(self, mOut: cute.Tensor):
        """(groups, row blocks up to 65535, slices of 65535 row blocks): one block per CTA."""
        blocks = cute.ceil_div(mOut.shape[0], self.rows_per_cta)
        grid_y = blocks
        if grid_y > MAX_GRID_Y:
            grid_y = Int32(MAX_GRID_Y)
        return [mOut.shape[1] // GROUP, grid_y, cute.ceil_div(blocks, MAX_GRID_Y)]

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mU: cute.Tensor, mOff: cute.Tensor, mCnt: cute.Tensor, mQ: cute.Tensor,
               mS: cute.Tensor):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        group, bidy, bidz = cute.arch.block_idx()
        block = bidz * MAX_GRID_Y + bidy
        end = rows_end(mOff, mQ.shape[0])
        smem = cutlass.memory.SmemAllocator()
        slots = thread_slots(self.piece_elems, self.num_threads, self.slots)
        sIn = smem.allocate_tensor(self.dtype, slots, byte_alignment=16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.num_threads // 32), byte_alignment=16)
        block_row = block * self.rows_per_cta
        if block_row < end:
            if cutlass.const_expr(self.has_counts):
                # A block of pure padding does nothing more, a partial one skips its padding rows.
                last_row = min(block_row + self.rows_per_cta, end) - 1
                limit = real_rows_end(mOff, mCnt, block_row, last_row, end, sWarp, tidx, self.num_threads)
                if block_row < limit:
                    self.block_rows(mG, mU, mQ, mS, sIn, block, limit, group, tidx)
            else:
                self.block_rows(mG, mU, mQ, mS, sIn, block, end, group, tidx)

    @cute.jit
    def pieces_of(self, mX: cute.Tensor, block: Int32, group: Int32, tidx: Int32):
        """This thread's pieces of ``mX`` (h's halves, or the codes): ``pieces[p][None, u]`` is piece
        p of its row u, the 8 elements at column ``group * 128 + (lane + 8 p) * 8`` of row
        ``block * 64 + tidx // 8 + 32 u``.  One base address; the rest are constant offsets and
        multiples of the row stride."""
        tile = cute.local_tile(mX, (self.rows_per_cta, GROUP), (block, group))
        parts = cute.flat_divide(tile, (self.rows_per_pass, self.piece_elems))  # (r, e, u, column piece)
        view = parts[tidx // self.lanes, None, None, None]
        lane = tidx % self.lanes
        return [view[None, None, lane + p * self.lanes] for p in range(self.pieces)]

    @cute.jit
    def block_rows(self, mG: cute.Tensor, mU: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, sIn: cute.Tensor,
                   block: Int32, limit: Int32, group: Int32, tidx: Int32):  # fmt: skip
        """The CTA's rows of one block: rows below ``limit`` are loaded, computed and stored."""
        first_row = block * self.rows_per_cta + tidx // self.lanes
        # cp.async of 16 bytes, L2 only (streamed data).
        g2s = load_16b_async(self.dtype)
        halves = (self.pieces_of(mG, block, group, tidx), self.pieces_of(mU, block, group, tidx))
        for u in cutlass.range_constexpr(self.rows_per_thread):
            if first_row + u * self.rows_per_pass < limit:
                for half in cutlass.range_constexpr(2):
                    for p in cutlass.range_constexpr(self.pieces):
                        cute.copy(g2s, halves[half][p][None, u], sIn[None, tidx, self.slot(u, half, p)])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        qPieces = self.pieces_of(mQ, block, group, tidx)
        # The scale of the thread's row u at sRows[u]: one address, computed once for both rows.
        sRows = cute.local_tile(mS, (self.rows_per_cta, 1), (block, group))
        sRows = cute.flat_divide(sRows, (self.rows_per_pass, 1))[tidx // self.lanes, 0, None, 0]
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float8E4M3FN, num_bits_per_copy=64)
        for u in cutlass.range_constexpr(self.rows_per_thread):
            # A row at or past limit computes on stale slots: its lanes still join the quantizer's
            # shuffles (which stay within the row's lanes), and nothing of it is stored.
            rIn = [cute.make_rmem_tensor((self.elems_per_lane,), self.dtype) for _ in range(2)]
            for half in cutlass.range_constexpr(2):
                for p in cutlass.range_constexpr(self.pieces):
                    piece = cute.zipped_divide(rIn[half], (self.piece_elems,))[None, p]
                    cute.autovec_copy(sIn[None, tidx, self.slot(u, half, p)], piece)
            rY = cute.make_rmem_tensor((self.elems_per_lane,), Float32)
            silu_mul(rIn[0], rIn[1], rY)
            rQ = cute.make_rmem_tensor((self.elems_per_lane,), cutlass.Float8E4M3FN)
            scale = quantize_group_fp8(rY, rQ, self.lanes, self.ue8m0, correctly_rounded=False)
            row = first_row + u * self.rows_per_pass
            if row < limit:
                for p in cutlass.range_constexpr(self.pieces):
                    cute.copy(store, cute.zipped_divide(rQ, (self.piece_elems,))[None, p], qPieces[p][None, u])
                if tidx % self.lanes == 0:
                    sRows[u] = scale

    def slot(self, u: int, half: int, p: int) -> int:
        """Shared-memory slot of piece p of gate (half 0) or up (half 1) of the thread's row u."""
        return (2 * u + half) * self.pieces + p


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
    mS = fake_tensor(Float32, (m, cute.sym_int()), (1, cute.sym_int64()), align=4)  # MN-major (checked_outputs)
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
