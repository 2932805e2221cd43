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

Mapping (both kernels): one (row, group of 128 columns) is handled by ``L``
consecutive lanes, each owning 16 bytes of input (bf16/fp16: ``L = 16`` lanes of
8 elements; fp8: ``L = 8`` lanes of 16 codes), as in ``quant_fp8``.  A CTA of 256
threads covers ``256 / L`` groups of lanes, each doing 4 consecutive output rows
of one group column: 64 (bf16) or 128 (fp8) rows per CTA; the grid is
``(H / 128, ceil(M_cap / rows_per_cta))`` with group columns fastest, so
neighbouring CTAs read neighbouring bytes of the same source rows.  A CTA first
stages its rows' token ids in shared memory (one coalesced load, a barrier), so
that every row load's address is ready at once:

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
the 65535 grid rows are covered by a grid-stride loop.  No inter-CTA
communication: one read of the gathered rows and one write of codes and scales,
so the floor is HBM bandwidth.

Constraints (``can_implement``): x bf16/fp16 (``permute_quant``), a_in
float8_e4m3fn (``permute``); H a multiple of 128; unit column stride with a
16-byte aligned base and row stride (checked on the host); ``a_in_scale`` f32
with any strides.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils
import torch
from cutlass import Float32, Int32

from ..compiler import arch_of_device, cached_compile, compile_kernel, fake_tensor, torch_to_cutlass_dtype
from .moe_rows import GROUP, RowGroupKernel, checked_outputs

QUANT_DTYPES = (torch.bfloat16, torch.float16)


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
        g2s = self.load_16b_async(self.dtype)
        smem = cutlass.utils.SmemAllocator()
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
        sTok = self.alloc_tokens(cutlass.utils.SmemAllocator())
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


def _fake_rows_io(in_dtype, num_tokens, hidden, m_cap):
    """Fake tensors shared by both kernels: source rows, maps, codes and scales of any strides."""
    mX = fake_tensor(in_dtype, (num_tokens, hidden), (cute.sym_int64(divisibility=128 // in_dtype.width), 1))
    mR2T = fake_tensor(cutlass.Int32, (m_cap,), (1,), align=4)
    mOff = fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), align=4)
    mQ = fake_tensor(cutlass.Uint8, (m_cap, hidden), (cute.sym_int64(divisibility=16), 1))
    mS = fake_tensor(Float32, (m_cap, cute.sym_int()), (cute.sym_int64(), cute.sym_int64()), align=4)
    return mX, mR2T, mOff, mQ, mS


@cached_compile
def compile_permute_quant(dtype: torch.dtype, ue8m0: bool, arch: str, keep_cubin: bool = False):
    """Compile for every T, H, M_cap, E and scale layout; the key is the scalars above."""
    cdtype = torch_to_cutlass_dtype(dtype)
    mX, mR2T, mOff, mQ, mS = _fake_rows_io(cdtype, cute.sym_int(), cute.sym_int(), cute.sym_int())
    return compile_kernel(PermuteQuantKernel(cdtype, ue8m0), mX, mR2T, mOff, mQ, mS, arch=arch, keep_cubin=keep_cubin)


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


def permute_quant_cuda(x: torch.Tensor, row_to_token: torch.Tensor, expert_offsets: torch.Tensor, scale_fmt=None):
    """Launch on x's device and current stream; inputs already validated by the op layer."""
    reason = PermuteQuantKernel.can_implement(x.dtype, x.shape[1])
    a, a_scale = checked_outputs("permute_quant", "x", x, reason, row_to_token.shape[0], x.shape[1])
    if a.numel() == 0:
        return a, a_scale
    fn = compile_permute_quant(x.dtype, scale_fmt == "ue8m0", arch_of_device(x.device))
    fn(_nonempty_rows(x), row_to_token, expert_offsets, a.view(torch.uint8), a_scale)
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
    quant_smem = PermuteQuantKernel(torch_to_cutlass_dtype(torch.bfloat16), False).smem_bytes()
    return [
        (
            f"permute_quant[bfloat16, scale_fmt={fmt}]",
            compile_permute_quant(torch.bfloat16, fmt == "ue8m0", arch, True),
            quant_smem,
        )
        for fmt in ("none", "ue8m0")
    ] + [("permute[float8_e4m3fn]", compile_permute(arch, True), PermuteKernel().smem_bytes())]
