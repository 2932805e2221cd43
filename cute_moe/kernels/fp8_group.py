"""Device-side FP8 group quantization shared by the kernels that quantize rows.

``quantize_group_fp8`` quantizes one group of ``G`` values spread over ``lanes``
consecutive lanes of a warp (each lane holding ``G / lanes`` of them in
registers), per the contract's formula::

    amax  = max(max |x|, 1e-6);  scale = amax / 448        (correctly rounded)
    ue8m0: scale = 2**ceil(log2(scale))                    (exactly, by exponent bits)
    q     = e4m3(clamp(x / scale, -448, 448))              (x / scale correctly rounded)

Every lane of the warp must call it (the amax is a full-warp butterfly shuffle),
so callers predicate only their loads and stores, never the call.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

FP8_MAX = 448.0
AMAX_FLOOR = 1e-6
_F32_EXP_MASK = 0x7F800000
_F32_MANTISSA_MASK = 0x007FFFFF


@cute.jit
def quantize_group_fp8(rX: cute.Tensor, rQ: cute.Tensor, lanes: cutlass.Constexpr, ue8m0: cutlass.Constexpr) -> Float32:
    """rX (registers, any float type) -> rQ (registers, e4m3); returns the group's scale."""
    n = cute.size(rX)
    x = rX.load().to(Float32)
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        amax = cute.arch.fmax(amax, abs(x[i]))
    amax = cute.arch.warp_reduction_max(amax, threads_in_group=lanes)
    scale = cute.arch.fmax(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX)

    rY = cute.make_rmem_tensor((n,), Float32)
    if cutlass.const_expr(ue8m0):
        # Smallest power of two >= scale: bump the exponent if any mantissa bit is set;
        # x / scale is then exactly x * 2**-e.
        scale_bits = (scale.bitcast(Int32) + Int32(_F32_MANTISSA_MASK)) & Int32(_F32_EXP_MASK)
        scale = scale_bits.bitcast(Float32)
        rY.store(x * (Int32(254 << 23) - scale_bits).bitcast(Float32))
    else:
        # x / scale, correctly rounded, with one division per group instead of one per element:
        # q0 = x * RN(1/s) is within an ulp, and one FMA residual step rounds it exactly
        # (Markstein); the residual x - s*q0 is exact in an FMA.
        inv_scale = Float32(1.0) / scale
        rY.store(x * inv_scale)
        for i in cutlass.range_constexpr(n):
            residual = cute.math.fma(-scale, rY[i], x[i])
            rY[i] = cute.math.fma(residual, inv_scale, rY[i])
    for i in cutlass.range_constexpr(n):
        rY[i] = cute.arch.fmin(cute.arch.fmax(rY[i], Float32(-FP8_MAX)), Float32(FP8_MAX))
    rQ.store(rY.load().to(cutlass.Float8E4M3FN))
    return scale


def lanes_per_group(elem_bytes: int, group_size: int) -> int:
    """Lanes sharing one group: each loads 16 bytes at least, at most 32 lanes (one warp)."""
    return min(32, group_size * elem_bytes // 16)
