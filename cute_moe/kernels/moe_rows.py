"""Device helpers shared by the kernels that walk the rows of an MoE layout
(``permute_quant``, ``permute``, ``silu_mul_quant``).

* ``rows_end``: the first row past the last expert segment, read on the device
  from ``expert_offsets[-1]`` (clamped to the buffer's ``M_cap`` rows), so the
  host never synchronises and the grid is sized from the static ``M_cap``.
* ``or_sign_bits``: gives every FP8 code the sign bit of its input.  The shared
  quantizer's residual step (``fp8_group.quantize_group_fp8``, scale_fmt None)
  computes ``x / scale`` as ``q0 + (x - scale*q0) / scale``, whose sum of two
  zeros is +0 in round-to-nearest, so an input of -0.0 comes out as code 0x00
  where the reference (true division) writes -0.0, code 0x80.  The sign of
  ``x / scale`` is the sign of ``x`` (scale > 0) for every input, so OR-ing the
  input's sign bit into the code's bit 7 is exact: it changes -0.0 inputs only.
  silu(g) * u yields -0.0 whenever silu(g) underflows to -0.0 (g < -88.7),
  which is common in large activations, so there the fix is not optional.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

_SIGN_BYTES = 0x80808080


@cute.jit
def rows_end(mOff: cute.Tensor, num_rows) -> Int32:
    """min(expert_offsets[-1], num_rows)."""
    end = mOff[mOff.shape[0] - 1]
    if end > num_rows:
        end = num_rows
    return end


@cute.jit
def or_sign_bits(rX: cute.Tensor, rQ: cute.Tensor):
    """rQ (registers, n FP8 codes) |= sign bits of rX (registers, n values of 16 or 32 bits).

    One PRMT gathers the four most significant bytes of four inputs (their sign
    bits are those bytes' bit 7) and one LOP3 merges them into four codes.
    """
    n = cute.size(rQ)
    words = cute.recast_tensor(rQ, Uint32)
    if cutlass.const_expr(rX.element_type.width == 16):
        src = cute.recast_tensor(rX, Uint32)  # two values per word; high bytes are bytes 1 and 3
        for w in cutlass.range_constexpr(n // 4):
            signs = Uint32(cute.arch.prmt(src[2 * w], src[2 * w + 1], Int32(0x7531)))
            words[w] = words[w] | (signs & Uint32(_SIGN_BYTES))
    else:
        src = cute.recast_tensor(rX, Uint32)  # one value per word; high byte is byte 3
        for w in cutlass.range_constexpr(n // 4):
            lo = cute.arch.prmt(src[4 * w], src[4 * w + 1], Int32(0x0073))
            hi = cute.arch.prmt(src[4 * w + 2], src[4 * w + 3], Int32(0x7300))
            signs = Uint32(cute.arch.prmt(lo, hi, Int32(0x7610)))
            words[w] = words[w] | (signs & Uint32(_SIGN_BYTES))
