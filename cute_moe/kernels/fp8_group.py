"""Device-side FP8 group quantization shared by the kernels that quantize rows.

``quantize_group_fp8`` quantizes one group of ``G`` values spread over ``lanes``
consecutive lanes of a warp (each lane holding ``G / lanes`` of them in
registers), per the contract's formula::

    amax  = max(max |x|, 1e-6);  scale = amax / 448        (correctly rounded)
    ue8m0: scale = 2**ceil(log2(scale))                    (exactly, by exponent bits)
    q     = e4m3(clamp(x / scale, -448, 448))              (x / scale correctly rounded)

``correctly_rounded=False`` (the default is True; ``silu_mul_quant`` passes False) takes
``RN(x * r)`` for the quotient, ``r`` the Newton-refined reciprocal of the scale: one multiply
per element instead of a multiply and two FMAs.  The scale is the same, bit for bit.  ``r``
equalled ``RN(1/scale)`` in every group tried (even from a reciprocal estimate one ulp off), and
then ``RN(x * r)`` is within one f32 ulp of ``RN(x / scale)``; were ``r`` an ulp off, within two.
The e4m3 conversion being monotonic, a code can only move to the neighbouring e4m3 value, and
only where the quotient lies within an ulp or two of an e4m3 rounding midpoint (exact ties
included).
Emulated on the CPU (8.4e7 elements per case), the fraction of codes that differ: 1.5e-7 for
x uniform in [-1, 1], 6e-7 for ``silu(g) * u`` of bf16 N(0, 1) data, 2.5e-6 with magnitudes
over six decades (products of bf16 values make short quotients, so exact ties are commoner).
ue8m0 scales are unaffected: their quotient is an exact multiplication by a power of two.

Every lane of the warp must call it (the amax is a full-warp butterfly shuffle),
so callers predicate only their loads and stores, never the call.
"""
from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..reference import AMAX_FLOOR, FP8_MAX  # the quantization the kernels reproduce bit for bit

_INV_FP8_MAX = struct.unpack("f", struct.pack("f", 1.0 / FP8_MAX))[0]  # RN_f32(1/448)
_F32_EXP_MASK = 0x7F800000
_F32_MANTISSA_MASK = 0x007FFFFF


@cute.jit
def quantize_group_fp8(rX: cute.Tensor, rQ: cute.Tensor, lanes: cutlass.Constexpr, ue8m0: cutlass.Constexpr,
                       correctly_rounded: cutlass.Constexpr = True) -> Float32:  # fmt: skip
    """rX (registers, any float type) -> rQ (registers, e4m3); returns the group's scale.
    ``correctly_rounded=False``: ``x * (1/scale)`` for ``x / scale`` (see the module docstring)."""
    x = to_f32(rX)
    return quantize_with_amax(x, group_amax(x, lanes), rQ, ue8m0, correctly_rounded)


@cute.jit
def group_amax(x, lanes: cutlass.Constexpr) -> Float32:
    """``max(max |x|, AMAX_FLOOR)`` over the group's values, ``x`` (an f32 vector) this lane's part
    of them.  A group split further (over two CTAs: the max of each part's result) has the same
    amax: the floor commutes with the max."""
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(x.shape)):
        amax = cute.arch.fmax(amax, abs(x[i]))
    return cute.arch.fmax(cute.arch.warp_reduction_max(amax, threads_in_group=lanes), Float32(AMAX_FLOOR))


@cute.jit
def quantize_with_amax(x, amax: Float32, rQ: cute.Tensor, ue8m0: cutlass.Constexpr,
                       correctly_rounded: cutlass.Constexpr = True) -> Float32:  # fmt: skip
    """``x`` (this lane's f32 values of a group whose amax is ``amax``) -> rQ (e4m3); returns the
    group's scale."""
    n = cute.size(x.shape)
    scale = _div_by_fp8_max(amax)

    rY = cute.make_rmem_tensor((n,), Float32)
    if cutlass.const_expr(ue8m0):
        # Smallest power of two >= scale: bump the exponent if any mantissa bit is set;
        # x / scale is then exactly x * 2**-e.
        scale_bits = (scale.bitcast(Int32) + Int32(_F32_MANTISSA_MASK)) & Int32(_F32_EXP_MASK)
        scale = scale_bits.bitcast(Float32)
        rY.store(x * (Int32(254 << 23) - scale_bits).bitcast(Float32))
    else:
        # x / scale, correctly rounded, as div.rn.f32's fast path computes it but with the
        # reciprocal shared by the group: 1/scale from MUFU.RCP and one Newton step, then
        # q0 = x * (1/scale) (the quotient when not correctly_rounded) and one FMA residual
        # step per element (Markstein; the residual x - scale*q0 is exact in an FMA). The
        # range checks that send div.rn to its slow path cannot fire here: scale is normal
        # (>= 1e-6/448) and |x / scale| <= 448.
        rcp = cute.arch.rcp_approx(scale)
        inv_scale = cute.math.fma(cute.math.fma(-scale, rcp, Float32(1.0)), rcp, rcp)
        # The residual is formed negated (scale*q0 - x), so that x = -0.0 keeps its sign:
        # q0 + (x - scale*q0)/scale would add +0 to -0 and round to +0.
        rY.store(x * inv_scale)
        if cutlass.const_expr(correctly_rounded):
            for i in cutlass.range_constexpr(n):
                neg_residual = cute.math.fma(scale, rY[i], -x[i])
                rY[i] = cute.math.fma(-neg_residual, inv_scale, rY[i])
    # The conversion saturates (cvt.rn.satfinite): the clamp to +-448 comes with it for
    # finite inputs, which the ops require.
    rQ.store(rY.load().to(cutlass.Float8E4M3FN))
    return scale


@cute.jit
def to_f32(rX: cute.Tensor):
    """Registers -> f32 vector. bf16 pairs widen with one integer op per element (the
    generic conversion spends two: a byte permute, then a shift)."""
    if cutlass.const_expr(rX.element_type == cutlass.BFloat16):
        n = cute.size(rX)
        pairs = rX.load().bitcast(Int32)
        rF = cute.make_rmem_tensor((n,), Float32)
        for i in cutlass.range_constexpr(n // 2):
            rF[2 * i] = (pairs[i] << 16).bitcast(Float32)
            rF[2 * i + 1] = (pairs[i] & Int32(-65536)).bitcast(Float32)
        return rF.load()
    return rX.load().to(Float32)


@cute.jit
def _div_by_fp8_max(a: Float32) -> Float32:
    """RN(a / 448) without a division: q = RN(a * RN(1/448)) is within an ulp and one FMA
    residual step rounds it correctly (Markstein), for every normal a."""
    q = a * Float32(_INV_FP8_MAX)
    return cute.math.fma(cute.math.fma(Float32(-FP8_MAX), q, a), Float32(_INV_FP8_MAX), q)


def lanes_per_group(elem_bytes: int, group_size: int) -> int:
    """Lanes sharing one group: each loads 16 bytes at least, at most 32 lanes (one warp)."""
    return min(32, group_size * elem_bytes // 16)
