"""Device and host pieces shared by the weighted-reduce kernels (finalize, moe_reduce).

Both kernels give a CTA of ``NUM_THREADS`` threads one token and one slab of
16-byte column vectors; each warp reads the token's ``k`` weights (and, for
finalize, row indices) once, lane ``j`` loading entry ``j``, and shuffles
broadcast them; ``weighted_row_sum`` then sums ``w_j * row_j`` over the slab in
f32, in order ``j``, with every row load of a batch in flight before its math.

Exactness: the products and sums are ``mul.rn.f32`` / ``add.rn.f32`` in inline
PTX.  Plain DSL arithmetic (``acc + w * x``) reaches PTX as ``fma.rn.f32``
(LLVM contracts it), which rounds once where the references round twice.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .host_checks import MAX_GRID_Y

NUM_THREADS = 128
MAX_K = 32  # lane j of a warp holds entry j
ROWS_PER_BATCH = 8  # row loads in flight together (for k > 8 the rows go in batches)


def vectors_per_thread(k: int) -> int:
    """16-byte column vectors per thread per row: four loads in flight at least, for small k."""
    return max(1, 4 // k)


# ----------------------------------------------------------------------------- device


def _asm(result_type, operands, text: str, constraints: str, loc, ip):
    return llvm.inline_asm(
        result_type, operands, text, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )  # fmt: skip


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """RN(a * b) in f32; the explicit rounding modifier keeps it out of any FMA contraction."""
    ops = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(_asm(Float32.mlir_type, ops, "mul.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """RN(a + b) in f32, never contracted with a preceding product."""
    ops = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(_asm(Float32.mlir_type, ops, "add.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def opaque_zero(nonneg, *, loc=None, ip=None) -> Int32:
    """``nonneg >> 31`` for a runtime value ``nonneg >= 0`` (a tensor extent): zero, but neither
    LLVM (inline PTX) nor ptxas (a kernel argument) can fold it."""
    ops = [Int32(nonneg).ir_value(loc=loc, ip=ip)]
    return Int32(_asm(Int32.mlir_type, ops, "shr.s32 $0, $1, 31;", "=r,r", loc, ip))


@dsl_user_op
def load_16b_or_zero(src: cute.Tensor, pred, dst: cute.Tensor, *, loc=None, ip=None) -> None:
    """dst (16 bytes of registers) = the 16 bytes at ``src`` if ``pred``, else zeros.

    One predicated ``ld.global.v4`` in inline PTX and no branch: a ``cute.copy`` under
    ``if pred`` becomes a branch into which LLVM sinks the element conversions, so that
    each load's data is consumed right after it.  When ``pred`` is false the address is
    never dereferenced.
    """
    i32 = Int32.mlir_type
    ops = [src.iterator.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip)]
    text = (
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $5, 0;\n\t"
        "mov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\tmov.b32 $2, 0;\n\tmov.b32 $3, 0;\n\t"
        "@p ld.global.v4.b32 {$0, $1, $2, $3}, [$4];\n\t}"
    )
    res = _asm(llvm.StructType.get_literal([i32] * 4), ops, text, "=r,=r,=r,=r,l,r", loc, ip)
    words = cute.recast_tensor(dst, Int32)
    for i in range(4):
        words[i] = Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip))


@cute.jit
def warp_entries(mT: cute.Tensor, token, k: cutlass.Constexpr, fill):
    """``[mT[token, j] for j < k]`` in every lane: lane j loads entry j, shuffles broadcast it."""
    lane = cute.arch.lane_idx()
    mine = fill
    if lane < k:
        mine = mT[token, lane]
    return [cute.arch.shuffle_sync(mine, j) for j in range(k)]


@cute.jit
def _after_loads(weights: list, loaded: list, zero: Int32) -> list:
    """The weights, bit for bit, but each computed from every register tile in ``loaded``.

    ``w | (OR of one word of each load & zero)`` equals ``w`` (``zero`` is ``opaque_zero``)
    yet depends on every load of the batch, so no product starts before all of them have
    landed.  Without it ptxas trades loads in flight for registers: it sinks each row's load
    below the math of the rows before it (32 registers, two 16-byte loads in flight).
    """
    tie = cute.recast_tensor(loaded[0], Int32)[0]
    for i in cutlass.range_constexpr(1, len(loaded)):
        tie = tie | cute.recast_tensor(loaded[i], Int32)[0]
    tie = tie & zero
    return [Float32((Float32(w).bitcast(Int32) | tie).bitcast(Float32)) for w in weights]


@cute.jit
def _axpy_rn(acc: cute.Tensor, w: Float32, rX: cute.Tensor, round_to: cutlass.Constexpr):
    """acc = RN(acc + RN(w * f32(x))) per element; with ``round_to``, the product and the new
    sum are also rounded to that type (accumulation in the row dtype, lmdeploy's fp32_acc=False)."""
    x = rX.load().to(Float32)
    prod = cute.make_rmem_tensor(acc.shape, Float32)
    for i in cutlass.range_constexpr(cute.size(acc)):
        prod[i] = mul_rn(w, x[i])
    if cutlass.const_expr(round_to is not None):
        prod.store(prod.load().to(round_to).to(Float32))
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = add_rn(acc[i], prod[i])
    if cutlass.const_expr(round_to is not None):
        acc.store(acc.load().to(round_to).to(Float32))


@cute.jit
def weighted_row_sum(
    rows: list,
    row_ok: list,
    weights: list,
    out_row: cute.Tensor,
    first_vec: Int32,
    num_vecs: Int32,
    zero: Int32,
    vec_stride: cutlass.Constexpr,
    vecs: cutlass.Constexpr,
    round_to: cutlass.Constexpr,
):
    """``out_row = sum_j weights[j] * rows[j]`` over this thread's 16-byte column vectors.

    The thread owns vectors ``first_vec + p * vec_stride`` (``p < vecs``) of every row; those
    past ``num_vecs`` are neither read nor written.  ``rows[j]`` (a 1-D row view) is read only
    where ``row_ok[j]``, else reads as zeros.  Rows go in batches of ``ROWS_PER_BATCH``: all
    loads of a batch, then its math, in order j; the accumulator is f32 (``round_to``: see
    ``_axpy_rn``), the result is converted once (RN) to ``out_row``'s type.
    """
    dtype = out_row.element_type
    elems = 128 // dtype.width
    k = len(rows)
    accs = []
    for p in cutlass.range_constexpr(vecs):
        acc = cute.make_rmem_tensor((elems,), Float32)
        acc.fill(0.0)
        accs.append(acc)

    for first in cutlass.range_constexpr(0, k, ROWS_PER_BATCH):
        last = min(first + ROWS_PER_BATCH, k)
        loaded = []
        for j in cutlass.range_constexpr(first, last):
            for p in cutlass.range_constexpr(vecs):
                vec = first_vec + p * vec_stride
                rX = cute.make_rmem_tensor((elems,), dtype)
                load_16b_or_zero(cute.local_tile(rows[j], (elems,), (vec,)), row_ok[j] & (vec < num_vecs), rX)
                loaded.append(rX)
        ws = _after_loads(weights[first:last], loaded, zero)
        for j in cutlass.range_constexpr(first, last):
            for p in cutlass.range_constexpr(vecs):
                _axpy_rn(accs[p], ws[j - first], loaded[(j - first) * vecs + p], round_to)

    store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    for p in cutlass.range_constexpr(vecs):
        vec = first_vec + p * vec_stride
        if vec < num_vecs:
            rO = cute.make_rmem_tensor((elems,), dtype)
            rO.store(accs[p].load().to(dtype))
            cute.copy(store, rO, cute.local_tile(out_row, (elems,), (vec,)))


# ----------------------------------------------------------------------------- host


def check_slabs(op: str, hidden: int, cols_per_cta: int) -> None:
    if -(-hidden // cols_per_cta) > MAX_GRID_Y:
        raise ValueError(f"cute_moe.{op}: H = {hidden} is too wide (at most {MAX_GRID_Y * cols_per_cta} columns)")
