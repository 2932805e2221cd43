"""Input validation shared by every ``cute_moe`` op.

Every check raises before any kernel runs, with a message of the form
``"cute_moe.<op>: <argument> <rule>, got <value>"``:

* ``TypeError`` -- an argument of the wrong Python type, or a tensor of the
  wrong dtype;
* ``ValueError`` -- everything else (shapes, ranges, devices, strides,
  alignment, unknown option strings).

The checks look at metadata only: dtype, shape, strides, device and (for CUDA
tensors) ``data_ptr()``. They never read tensor contents, so they never
synchronise the device and are safe inside CUDA graph capture. Rules that
need data (expert ids inside ``[0, num_experts)``, ``cu_seqlens_q[-1] ==
N_tok``, ...) cannot be checked here; the ops document them instead.

The checks are meant for real tensors; the ops call them from their CPU and
CUDA implementations.  The fake (meta) implementations run ``check_same_device``
and the checks of the scalars their output shapes are computed from.  A few rules
that only the GPU kernels impose are checked here too, before anything launches,
with ``NotImplementedError`` (top_k > 32 in ``fused_moe_routed``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

import torch
from torch import Tensor

from cute_moe import reference as R

__all__ = [
    "ACT_GROUP_SIZE",
    "FP8_DTYPE",
    "INT32_MAX",
    "KV_LAYOUTS",
    "ROUTING_METHODS",
    "SCALE_FMTS",
    "as_device",
    "check_align_sizes",
    "check_aligned_16",
    "check_bias_values",
    "check_bool",
    "check_choice",
    "check_divisible",
    "check_dtype",
    "check_float",
    "check_int",
    "check_last_dim_contiguous",
    "check_ndim",
    "check_routing_config",
    "check_same_device",
    "check_scale_fmt",
    "check_shape",
    "check_str",
    "check_tensor",
    "holds_data",
    "validate_align",
    "validate_fill_kv_cache_fp8",
    "validate_finalize",
    "validate_fused_moe",
    "validate_fused_moe_routed",
    "validate_grouped_gemm_fp8",
    "validate_grouped_gemm_fp8_swiglu",
    "validate_moe_reduce",
    "validate_permute",
    "validate_permute_quant",
    "validate_quant_fp8",
    "validate_route",
    "validate_silu_mul_quant",
    "weight_on_input",
]

# The contract's constants, defined once (in ``reference``, which the kernels' references share).
FP8_DTYPE = R.FP8_DTYPE
ACT_GROUP_SIZE = R.BLOCK  # activation / weight scale block along K (and N for weights)
SCALE_FMTS = R.SCALE_FMTS
ROUTING_METHODS = R.ROUTING_METHODS
KV_LAYOUTS = ("bshd", "bhsd")

_FLOAT_ACT = (torch.bfloat16, torch.float16, torch.float32)
_HALF_ACT = (torch.bfloat16, torch.float16)
_INDEX = (torch.int32,)
INT32_MAX = 2**31 - 1  # the kernels index rows, experts and offsets in int32
_F32 = torch.finfo(torch.float32)
_GPU_MAX_TOPK = 32  # finalize's and moe_reduce's kernels take k <= 32 (kernels/reduce_common.MAX_K)
# Tensor types whose data_ptr() is a real address: a Parameter built from a fake tensor has the
# fake tensor's type, not Parameter.
_PLAIN = (Tensor, torch.nn.Parameter)


def holds_data(t: Tensor) -> bool:
    """A tensor whose values and addresses can be read: not meta, not a fake tensor under tracing
    (a Parameter subclass, e.g. vLLM's weight parameters, counts by its data)."""
    plain = type(t) in _PLAIN or (isinstance(t, torch.nn.Parameter) and type(t.data) is Tensor)
    return plain and not t.is_meta


def _fail(op: str, msg: str, exc: type[Exception] = ValueError) -> NoReturn:
    raise exc(f"cute_moe.{op}: {msg}")


def _type_name(v: Any) -> str:
    """``int``, ``numpy.bool``: a builtin's bare name, anything else's with its module (numpy 2's
    bool is called ``bool`` too)."""
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------
# Composable checks
# ----------------------------------------------------------------------------


def check_tensor(op: str, name: str, t: Any, *, optional: bool = False) -> bool:
    """TypeError unless ``t`` is a Tensor (or None when ``optional``). Returns ``t is not None``."""
    if t is None and optional:
        return False
    if not isinstance(t, Tensor):
        want = "a torch.Tensor or None" if optional else "a torch.Tensor"
        _fail(op, f"{name} must be {want}, got {_type_name(t)}", TypeError)
    return True


def check_dtype(op: str, name: str, t: Tensor, dtypes: torch.dtype | Sequence[torch.dtype]) -> None:
    """TypeError unless ``t.dtype`` is one of ``dtypes``."""
    allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if t.dtype not in allowed:
        want = _dtype_name(allowed[0]) if len(allowed) == 1 else "one of " + ", ".join(map(_dtype_name, allowed))
        _fail(op, f"{name} must be {want}, got {t.dtype}", TypeError)


def check_ndim(op: str, name: str, t: Tensor, ndim: int, what: str = "") -> None:
    """ValueError unless ``t`` has ``ndim`` dimensions; ``what`` names them, e.g. ``"[T, H]"``."""
    if t.dim() != ndim:
        desc = f" {what}" if what else ""
        _fail(op, f"{name} must be {ndim}-D{desc}, got shape {_shape(t)}")


def check_shape(op: str, name: str, t: Tensor, expected: Sequence[Optional[int]], what: str = "") -> None:
    """ValueError unless ``t.shape`` matches ``expected`` (None = any size); ``what`` is the symbolic shape."""
    shape = t.shape
    if shape == tuple(expected):  # the common case, in one comparison
        return
    ok = len(shape) == len(expected) and all(e is None or s == e for s, e in zip(shape, expected))
    if not ok:
        exp = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        desc = f"{what} = {exp}" if what else exp
        _fail(op, f"{name} must have shape {desc}, got {_shape(t)}")


def check_same_device(op: str, **tensors: Optional[Tensor]) -> None:
    """ValueError unless every non-None tensor is on the device of the first one."""
    first: Optional[tuple[str, Tensor]] = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = (name, t)
        elif t.device != first[1].device:
            _fail(op, f"all tensors must be on one device: {first[0]} is on {first[1].device}, {name} is on {t.device}")


def check_divisible(op: str, what: str, value: int, divisor: int, divisor_what: str = "") -> None:
    """ValueError unless ``divisor`` divides ``value``; ``what`` describes ``value`` (e.g. ``"K (x.shape[1])"``)."""
    if value % divisor != 0:
        dw = f"{divisor_what} = {divisor}" if divisor_what else str(divisor)
        _fail(op, f"{what} must be divisible by {dw}, got {value}")


def check_last_dim_contiguous(op: str, name: str, t: Tensor) -> None:
    """ValueError unless the last dimension has stride 1 (any stride is fine for a size-1 or empty tensor)."""
    if t.dim() == 0 or t.numel() == 0 or t.shape[-1] == 1:
        return
    if t.stride(-1) != 1:
        _fail(op, f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides {tuple(t.stride())}")


def _is_fake(t: Tensor) -> bool:
    if t.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import is_fake  # cheap, torch is already imported

    return is_fake(t)


def check_aligned_16(op: str, name: str, t: Tensor, *, strides: bool = False) -> None:
    """For CUDA tensors only: ValueError unless ``data_ptr()`` is 16-byte aligned (TMA requirement).

    With ``strides=True`` also every stride of a dimension of size > 1, other than a unit
    stride, must be a multiple of 16 bytes. CPU, meta and fake tensors are not checked.
    """
    if not t.is_cuda or t.numel() == 0 or (type(t) is not Tensor and _is_fake(t)):
        return
    if t.data_ptr() % 16 != 0:
        _fail(
            op,
            f"{name} must be 16-byte aligned (data_ptr() % 16 == 0) on CUDA, got data_ptr() % 16 == {t.data_ptr() % 16}",
        )
    if strides:
        item = t.element_size()
        for d, (size, s) in enumerate(zip(t.shape, t.stride())):
            if size > 1 and s != 1 and (s * item) % 16 != 0:
                _fail(
                    op,
                    f"{name} strides must be multiples of 16 bytes on CUDA (TMA), got stride({d}) = {s} elements of {item} bytes",
                )


def check_int(
    op: str, name: str, v: Any, *, min: Optional[int] = None, max: Optional[int] = None, max_what: str = ""
) -> None:
    """TypeError unless ``v`` is an int (not bool); ValueError unless ``min <= v <= max``."""
    # A plain int first: the abstract-class check costs ~0.5 µs per call on a slow host.
    if type(v) is not int and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
        _fail(op, f"{name} must be an int, got {_type_name(v)}", TypeError)
    if min is not None and v < min:
        _fail(op, f"{name} must be >= {min}, got {v}")
    if max is not None and v > max:
        mw = f"{max_what} = {max}" if max_what else str(max)
        _fail(op, f"{name} must be <= {mw}, got {v}")


def check_bool(op: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(op, f"{name} must be a bool, got {_type_name(v)}", TypeError)


def check_bias_values(op: str, name: str, bias: Tensor) -> None:
    """A NaN or +inf selection bias wins every comparison: every token would go to that expert, with
    finite weights (-inf masks an expert).  Reads the data (a host sync on CUDA): the CPU ops,
    ``CUTE_MOE_DEBUG``, and FusedMoE's construction and load call it, never ``validate_*``."""
    if not holds_data(bias):
        return
    bad = bias.isnan() | (bias == float("inf"))
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        _fail(op, f"{name} must not be NaN or +inf, got {float(bias[e])} at expert {e}")


def check_str(op: str, name: str, v: Any) -> None:
    if not isinstance(v, str):
        _fail(op, f"{name} must be a str, got {_type_name(v)}", TypeError)


def check_float(op: str, name: str, v: Any) -> None:
    if type(v) is not float and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
        _fail(op, f"{name} must be a float, got {_type_name(v)}", TypeError)


def check_choice(op: str, name: str, v: Any, choices: Sequence[Any]) -> None:
    """ValueError unless ``v`` is one of ``choices``."""
    if type(choices) is tuple and (v is None or type(v) is str) and v in choices:  # the common case
        return
    if not any(v is c if c is None else (isinstance(v, str) and v == c) for c in choices):
        opts = ", ".join(repr(c) for c in choices)
        _fail(op, f"{name} must be one of {opts}, got {v!r}")


def check_scale_fmt(op: str, name: str, v: Any) -> None:
    check_choice(op, name, v, SCALE_FMTS)


def as_device(op: str, name: str, v: Any) -> Optional[torch.device]:
    """``v`` (None, a torch.device, a device string or index) as a torch.device, or None; an
    unknown device string, or CUDA where torch has none, is a ValueError naming ``name``, not
    torch's RuntimeError or AssertionError from the first allocation."""
    if v is None:
        return None
    if not isinstance(v, (torch.device, str, int)) or isinstance(v, bool):
        _fail(op, f"{name} must be None, a torch.device, a str or an int, got {_type_name(v)}", TypeError)
    try:
        device = torch.device("cuda", v) if isinstance(v, int) else torch.device(v)  # an index: a CUDA device's
    except RuntimeError as exc:
        _fail(op, f"{name} is not a device: {v!r} ({exc})")
    if device.type == "cuda" and not torch.cuda.is_available():
        _fail(op, f"{name} is {v!r}, but this torch has no CUDA device")
    return device


def _tensor(
    op: str,
    name: str,
    t: Any,
    dtypes: torch.dtype | Sequence[torch.dtype],
    ndim: int,
    what: str = "",
    *,
    last_dim_contiguous: bool = True,
    tma: bool = False,
) -> None:
    """The checks every tensor argument gets: type, dtype, ndim, strides, CUDA alignment.

    Written as one pass over the tensor's metadata that calls the detailed checkers (which
    raise with the message) only when a rule fails: this runs on every eager call.
    """
    if not isinstance(t, Tensor):
        check_tensor(op, name, t)
    dtype = t.dtype
    if dtype is not dtypes if isinstance(dtypes, torch.dtype) else dtype not in dtypes:
        check_dtype(op, name, t, dtypes)
    shape = t.shape
    if len(shape) != ndim:
        check_ndim(op, name, t, ndim, what)
    stride = t.stride()  # one tuple: cheaper than two stride(d) calls
    if last_dim_contiguous and ndim and shape[-1] != 1 and stride[-1] != 1:
        check_last_dim_contiguous(op, name, t)
    if t.is_cuda:
        # A plain tensor (or parameter) with an aligned base and strides passes here; any failure,
        # and any other tensor type (a fake tensor's data_ptr() is not real), goes to the detailed
        # check, which raises with the message or lets an empty tensor through.
        if type(t) not in _PLAIN or t.data_ptr() % 16:
            check_aligned_16(op, name, t, strides=tma)
        elif tma:
            item = dtype.itemsize
            for size, s in zip(shape, stride):
                if size > 1 and s != 1 and (s * item) % 16:
                    check_aligned_16(op, name, t, strides=True)
                    return


def _offsets(op: str, name: str, t: Any, num: Optional[int] = None, num_what: str = "") -> int:
    """expert_offsets: int32 1-D with at least 2 entries (E + 1, E >= 1). Returns E."""
    _tensor(op, name, t, _INDEX, 1, "[E + 1]")
    if t.shape[0] < 2:
        _fail(op, f"{name} must have E + 1 >= 2 entries, got shape {_shape(t)}")
    if num is not None and t.shape[0] != num + 1:
        _fail(op, f"{name} must have shape [E + 1] = [{num + 1}] ({num_what} = {num}), got {_shape(t)}")
    return t.shape[0] - 1


# ----------------------------------------------------------------------------
# One validate_<op> per op; the signatures mirror the ops'.
# ----------------------------------------------------------------------------


def validate_quant_fp8(
    x: Tensor, group_size: int = 128, scale_fmt: Optional[str] = None, column_major_scales: bool = False
) -> None:
    op = "quant_fp8"
    _tensor(op, "x", x, _FLOAT_ACT, 2, "[M, K]")
    check_int(op, "group_size", group_size, min=1)
    check_divisible(op, "K (x.shape[1])", x.shape[1], group_size, "group_size")
    check_scale_fmt(op, "scale_fmt", scale_fmt)
    check_bool(op, "column_major_scales", column_major_scales)


def check_routing_config(
    op: str,
    num_experts: int,
    top_k: Any,
    method: Any,
    n_group: Any,
    topk_group: Any,
    routed_scaling_factor: Any,
    has_bias: bool,
    method_name: str = "method",
    experts_what: str = "num_experts",
) -> None:
    """The routing rules on scalars (shared by the ops and ``FusedMoE``'s configuration)."""
    check_choice(op, method_name, method, ROUTING_METHODS)
    check_int(op, "top_k", top_k, min=1, max=num_experts, max_what=experts_what)
    check_int(op, "n_group", n_group, min=1)
    check_int(op, "topk_group", topk_group, min=1)
    check_float(op, "routed_scaling_factor", routed_scaling_factor)
    try:
        finite = math.isfinite(routed_scaling_factor)
    except OverflowError:  # an int past the float range
        finite = False
    # The kernels and the reference scale in float32: a factor outside its normal range would
    # turn every weight into inf or 0.
    if not (finite and _F32.tiny <= routed_scaling_factor <= _F32.max):
        _fail(op, f"routed_scaling_factor must be finite and > 0 within float32's normal range "
                  f"[{_F32.tiny}, {_F32.max}], got {routed_scaling_factor}")  # fmt: skip
    if has_bias and method != "deepseek_v3":
        _fail(op, f"score_bias is only allowed with {method_name}='deepseek_v3', got {method_name}={method!r}")
    if method != "deepseek_v3":
        if n_group != 1 or topk_group != 1:
            _fail(
                op,
                f"n_group and topk_group must be 1 unless {method_name}='deepseek_v3', "
                f"got n_group={n_group}, topk_group={topk_group} with {method_name}={method!r}",
            )
        return
    check_divisible(op, experts_what, num_experts, n_group, "n_group")
    check_int(op, "topk_group", topk_group, max=n_group, max_what="n_group")
    check_int(
        op, "top_k", top_k, max=topk_group * (num_experts // n_group), max_what="topk_group * (num_experts / n_group)"
    )


def _check_routing(
    op: str,
    router_logits: Tensor,
    top_k: int,
    method: str,
    score_bias: Optional[Tensor],
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    method_name: str,
) -> None:
    _tensor(op, "router_logits", router_logits, _HALF_ACT + (torch.float32,), 2, "[T, E]")
    E = router_logits.shape[1]
    if E < 1:
        _fail(op, f"router_logits must have at least one expert column, got shape {_shape(router_logits)}")
    has_bias = check_tensor(op, "score_bias", score_bias, optional=True)
    check_routing_config(
        op, E, top_k, method, n_group, topk_group, routed_scaling_factor, has_bias, method_name,
        "num_experts (router_logits.shape[1])",
    )  # fmt: skip
    if has_bias:
        _tensor(op, "score_bias", score_bias, torch.float32, 1, "[E]")
        check_shape(op, "score_bias", score_bias, (E,), "[E]")


def validate_route(
    router_logits: Tensor,
    top_k: int,
    method: str,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> None:
    op = "route"
    _check_routing(op, router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor, "method")
    check_same_device(op, router_logits=router_logits, score_bias=score_bias)


def _check_expert_range(
    op: str, expert_offset: int, e_local: int, num_experts: int, e_local_what: str, num_what: str
) -> None:
    check_int(op, "expert_offset", expert_offset, min=0)
    if expert_offset + e_local > num_experts:
        _fail(
            op,
            f"expert_offset + {e_local_what} must be <= {num_what}, got {expert_offset} + {e_local} > {num_experts}",
        )


def check_align_sizes(num_experts: Any, alignment: Any, num_local_experts: Any) -> None:
    """align's scalars that its output shapes are computed from (also checked by its fake)."""
    op = "align"
    check_int(op, "num_experts", num_experts, min=1, max=INT32_MAX, max_what="2**31 - 1")
    check_int(op, "alignment", alignment, min=1, max=INT32_MAX, max_what="2**31 - 1")
    if num_local_experts is not None:
        check_int(op, "num_local_experts", num_local_experts, min=1)


def validate_align(
    topk_ids: Tensor,
    num_experts: int,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts: Optional[int] = None,
) -> None:
    op = "align"
    _tensor(op, "topk_ids", topk_ids, _INDEX, 2, "[T, k]")
    check_align_sizes(num_experts, alignment, num_local_experts)
    e_local = num_experts if num_local_experts is None else num_local_experts
    e_local_what = "num_local_experts" if num_local_experts is not None else "num_local_experts (default num_experts)"
    _check_expert_range(op, expert_offset, e_local, num_experts, e_local_what, "num_experts")
    if topk_ids.shape[1] > num_experts:
        _fail(op, f"top_k (topk_ids.shape[1]) must be <= num_experts = {num_experts}, got {topk_ids.shape[1]}")
    T, k = topk_ids.shape
    if R.m_cap(T, k, e_local, alignment) > INT32_MAX:
        _fail(op, f"M_cap = round_up(T*k + min(T*k, E_local)*(alignment - 1), alignment) must fit in int32, got "
                  f"T = {T}, k = {k}, E_local = {e_local}, alignment = {alignment}")  # fmt: skip


def _check_permute_maps(op: str, row_to_token: Tensor, expert_offsets: Tensor) -> None:
    _tensor(op, "row_to_token", row_to_token, _INDEX, 1, "[M_cap]")
    _offsets(op, "expert_offsets", expert_offsets)


def validate_permute_quant(
    x: Tensor,
    row_to_token: Tensor,
    expert_offsets: Tensor,
    scale_fmt: Optional[str] = None,
    token_to_row: Optional[Tensor] = None,
    zero_padding: bool = True,
) -> None:
    op = "permute_quant"
    check_bool(op, "zero_padding", zero_padding)
    _tensor(op, "x", x, _HALF_ACT, 2, "[T, H]")
    check_divisible(op, "H (x.shape[1])", x.shape[1], ACT_GROUP_SIZE)
    _check_permute_maps(op, row_to_token, expert_offsets)
    check_scale_fmt(op, "scale_fmt", scale_fmt)
    if check_tensor(op, "token_to_row", token_to_row, optional=True):
        _tensor(op, "token_to_row", token_to_row, (torch.int32, torch.int64), 2, "[T, k]")
        check_shape(op, "token_to_row", token_to_row, (x.shape[0], None), "[T, k] (T = x.shape[0])")
    check_same_device(
        op, x=x, row_to_token=row_to_token, expert_offsets=expert_offsets, token_to_row=token_to_row
    )


def validate_permute(a_in: Tensor, a_in_scale: Tensor, row_to_token: Tensor, expert_offsets: Tensor) -> None:
    op = "permute"
    _tensor(op, "a_in", a_in, FP8_DTYPE, 2, "[T, H]")
    T, H = a_in.shape
    check_divisible(op, "H (a_in.shape[1])", H, ACT_GROUP_SIZE)
    _tensor(op, "a_in_scale", a_in_scale, torch.float32, 2, "[T, H/128]", last_dim_contiguous=False)
    check_shape(op, "a_in_scale", a_in_scale, (T, H // ACT_GROUP_SIZE), "[T, H/128]")
    _check_permute_maps(op, row_to_token, expert_offsets)
    check_same_device(op, a_in=a_in, a_in_scale=a_in_scale, row_to_token=row_to_token, expert_offsets=expert_offsets)


def _check_gemm(
    op: str,
    a: Optional[Tensor],
    a_scale: Optional[Tensor],
    b: Tensor,
    b_scale: Tensor,
    names: tuple[str, str, str, str],
    K: Optional[int] = None,
    N: Optional[int] = None,
    E: Optional[int] = None,
) -> tuple[int, int, int]:
    """The B operand (and A when given) of a grouped GEMM. Returns (E, N, K)."""
    an, asn, bn, bsn = names
    if a is not None:
        _tensor(op, an, a, FP8_DTYPE, 2, "[M, K]", tma=True)
    _tensor(op, bn, b, FP8_DTYPE, 3, "[E, N, K]", tma=True)
    Eb, Nb, Kb = b.shape
    if a is not None and a.shape[1] != Kb:
        _fail(op, f"{an}.shape[1] (K = {a.shape[1]}) must equal {bn}.shape[2] (K = {Kb})")
    if E is not None or N is not None or K is not None:
        for want, got, what in ((E, Eb, "E"), (N, Nb, "N"), (K, Kb, "K")):
            if want is not None and want != got:
                _fail(op, f"{bn} must have {what} = {want}, got shape {_shape(b)}")
    if Kb % ACT_GROUP_SIZE or Nb % 8:  # (the messages' f-strings only on the error path)
        check_divisible(op, f"K ({bn}.shape[2])", Kb, ACT_GROUP_SIZE)
        check_divisible(op, f"N ({bn}.shape[1])", Nb, 8)
    if a is not None:
        _tensor(op, asn, a_scale, torch.float32, 2, "[M, K/128]", last_dim_contiguous=False)
        check_shape(op, asn, a_scale, (a.shape[0], Kb // ACT_GROUP_SIZE), "[M, K/128]")
    # A unit last stride: the [E, N/128, K/128] weight_scale_inv layout the kernels load from.
    _tensor(op, bsn, b_scale, torch.float32, 3, "[E, ceil(N/128), K/128]")
    check_shape(op, bsn, b_scale, (Eb, _cdiv(Nb, ACT_GROUP_SIZE), Kb // ACT_GROUP_SIZE), "[E, ceil(N/128), K/128]")
    return Eb, Nb, Kb


def validate_grouped_gemm_fp8(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    expected_m: Optional[int] = None,
) -> None:
    _check_grouped_gemm("grouped_gemm_fp8", ("a", "a_scale", "b", "b_scale"), a, a_scale, b, b_scale, expert_offsets,
                        expert_counts, expected_m)  # fmt: skip


def _check_grouped_gemm(op: str, names: tuple[str, str, str, str], a: Tensor, a_scale: Tensor, b: Tensor,
                        b_scale: Tensor, expert_offsets: Tensor, expert_counts: Optional[Tensor],
                        expected_m: Optional[int]) -> tuple[int, int, int]:  # fmt: skip
    """Both grouped GEMM ops' operands (``names``: how the op calls a, a_scale, b, b_scale), segments,
    devices and launch hint; returns (E, N, K)."""
    if a is None:  # (``_check_gemm`` takes a None A as "weights only")
        check_tensor(op, names[0], a)
    E, N, K = _check_gemm(op, a, a_scale, b, b_scale, names)
    experts = f"E = {names[2]}.shape[0]"
    _offsets(op, "expert_offsets", expert_offsets, E, experts)
    if check_tensor(op, "expert_counts", expert_counts, optional=True):
        _tensor(op, "expert_counts", expert_counts, torch.int32, 1, "[E]")
        check_shape(op, "expert_counts", expert_counts, (E,), f"[E] ({experts})")
    check_same_device(op, **dict(zip(names, (a, a_scale, b, b_scale))), expert_offsets=expert_offsets,
                      expert_counts=expert_counts)  # fmt: skip
    if expected_m is not None:
        check_int(op, "expected_m", expected_m, min=0)
    return E, N, K


def validate_grouped_gemm_fp8_swiglu(
    a: Tensor,
    a_scale: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expected_m: Optional[int] = None,
) -> None:
    op = "grouped_gemm_fp8_swiglu"
    _, N, _ = _check_grouped_gemm(op, ("a", "a_scale", "w13", "w13_scale"), a, a_scale, w13, w13_scale,
                                  expert_offsets, expert_counts, expected_m)  # fmt: skip
    if N % (2 * ACT_GROUP_SIZE) != 0:
        _fail(op, f"w13.shape[1] = 2I must have I divisible by {ACT_GROUP_SIZE}, got 2I = {N}")
    check_bool(op, "gate_first", gate_first)
    check_scale_fmt(op, "scale_fmt", scale_fmt)


def validate_silu_mul_quant(
    h: Tensor,
    expert_offsets: Tensor,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expert_counts: Optional[Tensor] = None,
) -> None:
    op = "silu_mul_quant"
    _tensor(op, "h", h, torch.bfloat16, 2, "[M, 2I]")
    if h.shape[1] % (2 * ACT_GROUP_SIZE) != 0:
        _fail(op, f"h.shape[1] = 2I must have I divisible by {ACT_GROUP_SIZE}, got 2I = {h.shape[1]}")
    E = _offsets(op, "expert_offsets", expert_offsets)
    check_bool(op, "gate_first", gate_first)
    check_scale_fmt(op, "scale_fmt", scale_fmt)
    if check_tensor(op, "expert_counts", expert_counts, optional=True):
        _tensor(op, "expert_counts", expert_counts, torch.int32, 1, "[E]")
        check_shape(op, "expert_counts", expert_counts, (E,), "[E] (E + 1 = expert_offsets.shape[0])")
    check_same_device(op, h=h, expert_offsets=expert_offsets, expert_counts=expert_counts)


def _check_topk_pair(
    op: str, weights: Tensor, ids: Tensor, w_name: str, i_name: str, T: Optional[int] = None, w_dtypes=torch.float32
) -> None:
    _tensor(op, w_name, weights, w_dtypes, 2, "[T, k]")
    _tensor(op, i_name, ids, _INDEX, 2, "[T, k]")
    check_shape(op, i_name, ids, tuple(weights.shape), f"[T, k] (the shape of {w_name})")
    if T is not None and weights.shape[0] != T:
        _fail(op, f"{w_name}.shape[0] must equal the number of tokens T = {T}, got {weights.shape[0]}")


def validate_finalize(y: Tensor, topk_weights: Tensor, token_to_row: Tensor) -> None:
    op = "finalize"
    _tensor(op, "y", y, torch.bfloat16, 2, "[M_cap, H]")
    _check_topk_pair(op, topk_weights, token_to_row, "topk_weights", "token_to_row")
    check_same_device(op, y=y, topk_weights=topk_weights, token_to_row=token_to_row)


def validate_moe_reduce(hidden: Tensor, weights: Tensor, fp32_acc: bool = False) -> None:
    op = "moe_reduce"
    _tensor(op, "hidden", hidden, _FLOAT_ACT, 3, "[T, k, H]")
    _tensor(op, "weights", weights, torch.float32, 2, "[T, k]")
    check_shape(op, "weights", weights, tuple(hidden.shape[:2]), "[T, k] (hidden.shape[:2])")
    check_bool(op, "fp32_acc", fp32_acc)
    check_same_device(op, hidden=hidden, weights=weights)


def _check_moe_weights(
    op: str,
    x: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    gate_first: bool,
    act_scale_fmt: Optional[str],
) -> int:
    """x and the expert weights of a fused MoE layer. Returns E_local."""
    _tensor(op, "x", x, _HALF_ACT, 2, "[T, H]", tma=True)
    H = x.shape[1]
    check_divisible(op, "H (x.shape[1])", H, ACT_GROUP_SIZE)
    if H == 0:
        _fail(op, f"H (x.shape[1]) must be >= {ACT_GROUP_SIZE}, got 0")
    if isinstance(w13, Tensor) and w13.ndim == 3 and w13.shape[2] != H:  # (either may be the wrong one)
        _fail(op, f"x.shape[1] (H = {H}) must equal w13.shape[2] (H = {w13.shape[2]})")
    E, two_i, _ = _check_gemm(op, None, None, w13, w13_scale, ("", "", "w13", "w13_scale"), K=H)
    if E == 0:
        _fail(op, "E_local (w13.shape[0]) must be >= 1, got 0")
    if two_i % (2 * ACT_GROUP_SIZE) != 0:
        _fail(op, f"w13.shape[1] = 2I must have I divisible by {ACT_GROUP_SIZE}, got 2I = {two_i}")
    if two_i == 0:
        _fail(op, f"w13.shape[1] = 2I must have I >= {ACT_GROUP_SIZE}, got 2I = 0")
    _check_gemm(op, None, None, w2, w2_scale, ("", "", "w2", "w2_scale"), K=two_i // 2, N=H, E=E)
    check_bool(op, "gate_first", gate_first)
    check_scale_fmt(op, "act_scale_fmt", act_scale_fmt)
    return E


def weight_on_input(op: str, flag: Any, routing_method: Optional[str]) -> bool:
    """``apply_router_weight_on_input``, resolved: ``None`` takes the routing method's convention (on the
    input for ``llama4``, as HF Llama-4 and vLLM apply it; on the expert outputs otherwise)."""
    if flag is None:
        flag = routing_method == "llama4"
    check_bool(op, "apply_router_weight_on_input", flag)
    return flag


def validate_fused_moe_routed(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    expert_offset: int = 0,
    gate_first: bool = True,
    act_scale_fmt: Optional[str] = None,
    apply_router_weight_on_input: bool = False,
    num_experts: Optional[int] = None,
) -> bool:
    """Returns ``apply_router_weight_on_input``."""
    op = "fused_moe_routed"
    e_local = _check_moe_weights(op, x, w13, w13_scale, w2, w2_scale, gate_first, act_scale_fmt)
    # 16-bit weights (an HF router's, in a bf16 model) are taken: the layer converts them to f32, exactly
    _check_topk_pair(op, topk_weights, topk_ids, "topk_weights", "topk_ids", T=x.shape[0], w_dtypes=_FLOAT_ACT)
    check_int(op, "expert_offset", expert_offset, min=0, max=INT32_MAX - e_local, max_what="2**31 - 1 - E_local")
    if num_experts is not None:
        check_int(op, "num_experts", num_experts, min=1)
        _check_expert_range(op, expert_offset, e_local, num_experts, "E_local (w13.shape[0])", "num_experts")
    if x.is_cuda and x.shape[0] and topk_ids.shape[1] > _GPU_MAX_TOPK:  # T = 0 launches nothing
        # Checked here, not by finalize at the end, so that nothing has launched yet.
        _fail(op, f"top_k (topk_ids.shape[1]) must be <= {_GPU_MAX_TOPK} on the GPU, got {topk_ids.shape[1]}",
              NotImplementedError)  # fmt: skip
    check_same_device(
        op, x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale
    )
    return weight_on_input(op, apply_router_weight_on_input, None)


def validate_fused_moe(
    x: Tensor,
    router_logits: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    top_k: int,
    routing_method: str,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    expert_offset: int = 0,
    num_experts: Optional[int] = None,
    gate_first: bool = True,
    act_scale_fmt: Optional[str] = None,
    apply_router_weight_on_input: Optional[bool] = None,
) -> bool:
    """Returns ``apply_router_weight_on_input``, resolved (see :func:`weight_on_input`)."""
    op = "fused_moe"
    e_local = _check_moe_weights(op, x, w13, w13_scale, w2, w2_scale, gate_first, act_scale_fmt)
    _check_routing(
        op,
        router_logits,
        top_k,
        routing_method,
        score_bias,
        n_group,
        topk_group,
        routed_scaling_factor,
        "routing_method",
    )
    if router_logits.shape[0] != x.shape[0]:
        _fail(
            op,
            f"router_logits.shape[0] must equal the number of tokens T = x.shape[0] = {x.shape[0]}, got {router_logits.shape[0]}",
        )
    e_global = router_logits.shape[1]
    if num_experts is not None:
        check_int(op, "num_experts", num_experts, min=1)
        if num_experts != e_global:
            _fail(op, f"num_experts must equal router_logits.shape[1] = {e_global} when given, got {num_experts}")
    _check_expert_range(
        op, expert_offset, e_local, e_global, "E_local (w13.shape[0])", "num_experts (router_logits.shape[1])"
    )
    check_same_device(
        op,
        x=x,
        router_logits=router_logits,
        w13=w13,
        w13_scale=w13_scale,
        w2=w2,
        w2_scale=w2_scale,
        score_bias=score_bias,
    )
    return weight_on_input(op, apply_router_weight_on_input, routing_method)


def _kv_cache_shape(layout: str, cache: Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, H_kv, D) of a cache tensor in ``layout``."""
    nb, d1, d2, d = cache.shape
    return (nb, d1, d2, d) if layout == "bshd" else (nb, d2, d1, d)


def _check_kv_side(
    op: str,
    layout: str,
    group_size: int,
    states: Tensor,
    cache: Tensor,
    scale_cache: Tensor,
    names: tuple[str, str, str],
    ref: Optional[tuple[int, int, int]] = None,
) -> tuple[int, int, int]:
    """One of K / V: states [N, H_kv, D], fp8 cache and f32 scale cache. Returns (N, num_blocks, block_size)."""
    sn, cn, scn = names
    _tensor(op, sn, states, _FLOAT_ACT, 3, "[N_tok, H_kv, D]")
    N, H_kv, D = states.shape
    if H_kv < 1 or D < 1:
        _fail(op, f"{sn} must have H_kv >= 1 and D >= 1 ([N_tok, H_kv, D]), got shape {_shape(states)}")
    check_divisible(op, f"D ({sn}.shape[2])", D, group_size, "group_size")
    what = "[num_blocks, block_size, H_kv, D]" if layout == "bshd" else "[num_blocks, H_kv, block_size, D]"
    _tensor(op, cn, cache, FP8_DTYPE, 4, f"{what} (layout={layout!r})")
    nb, bs, ch, cd = _kv_cache_shape(layout, cache)
    if bs < 1:
        _fail(op, f"{cn} must have block_size >= 1 in layout {layout!r} {what}, got shape {_shape(cache)}")
    if (ch, cd) != (H_kv, D):
        _fail(
            op,
            f"{cn} must have H_kv = {H_kv} and D = {D} ({sn}.shape[1:]) in layout {layout!r} {what}, got shape {_shape(cache)}",
        )
    if ref is not None and (N, nb, bs) != ref:
        _fail(
            op,
            f"{sn} / {cn} must match the K side: N_tok = {ref[0]}, num_blocks = {ref[1]}, block_size = {ref[2]}, "
            f"got N_tok = {N}, num_blocks = {nb}, block_size = {bs}",
        )
    _tensor(op, scn, scale_cache, torch.float32, 4, f"{what} with D/group_size (layout={layout!r})")
    sexp = (nb, bs, H_kv, D // group_size) if layout == "bshd" else (nb, H_kv, bs, D // group_size)
    check_shape(op, scn, scale_cache, sexp, f"{cn}.shape with last dim D/group_size")
    for name, t in ((cn, cache), (scn, scale_cache)):
        _check_no_self_overlap(op, name, t)
    return N, nb, bs


def _nested_dims(t: Tensor) -> Optional[list[tuple[int, int]]]:
    """(size, stride) of ``t``'s dims of size > 1, largest stride first, when each stride exceeds
    the largest offset the smaller-stride dims reach (every permutation of a dense or padded
    tensor): then no two elements share an address, and an offset between two such views has at
    most one decomposition per dim.  None otherwise."""
    dims = sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1], reverse=True)
    reach = 0
    for n, st in reversed(dims):
        if st <= reach:
            return None
        reach += (n - 1) * st
    return dims


def _check_no_self_overlap(op: str, name: str, t: Tensor) -> None:
    """A written tensor must not map two elements to one address (an ``expand``ed or
    ``as_strided`` view): the kernels would race on them.  A contiguous tensor cannot; any other
    must have strides that nest (``_nested_dims``), which torch's own check cannot always tell."""
    if not t.is_contiguous() and t.numel() > 1 and _nested_dims(t) is None:
        _fail(op, f"{name} must have strides that nest (each larger than the span of the smaller-stride dims), "
                  f"so that no two elements can share an address; got strides {tuple(t.stride())} for shape "
                  f"{_shape(t)} (a zero stride, e.g. from expand, or an as_strided view)")  # fmt: skip


def _share_an_element(a: Tensor, b: Tensor) -> bool:
    """Whether two views of one dtype, each checked by ``_check_no_self_overlap``, have an element
    address in common.  Exact for views of equal shape and strides (K and V sliced from one
    buffer, interleaved or not); views of other strides count as sharing when their byte ranges
    meet."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    item = a.element_size()
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    hi_a = lo_a + item * (1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())))
    hi_b = lo_b + item * (1 + sum((n - 1) * st for n, st in zip(b.shape, b.stride())))
    if hi_a <= lo_b or hi_b <= lo_a:
        return False
    dims = _nested_dims(a)
    if a.shape != b.shape or a.stride() != b.stride() or (lo_b - lo_a) % item or dims is None:
        return True

    def reachable(delta: int, i: int) -> bool:  # delta = sum of c_j * stride_j, |c_j| < size_j, j >= i
        if i == len(dims):
            return delta == 0
        n, st = dims[i]
        below = sum((m - 1) * s for m, s in dims[i + 1:])
        c_lo, c_hi = max(-(n - 1), -((below - delta) // st)), min(n - 1, (delta + below) // st)
        return any(reachable(delta - c * st, i + 1) for c in range(c_lo, c_hi + 1))

    return reachable((lo_b - lo_a) // item, 0)


def validate_fill_kv_cache_fp8(
    k_states: Tensor,
    v_states: Optional[Tensor],
    k_cache: Tensor,
    v_cache: Optional[Tensor],
    k_scale_cache: Tensor,
    v_scale_cache: Optional[Tensor],
    cu_seqlens_q: Tensor,
    kv_seqlens: Tensor,
    block_offsets: Tensor,
    group_size: int = 128,
    scale_fmt: Optional[str] = None,
    layout: str = "bshd",
) -> None:
    op = "fill_kv_cache_fp8"
    check_choice(op, "layout", layout, KV_LAYOUTS)
    check_scale_fmt(op, "scale_fmt", scale_fmt)
    check_int(op, "group_size", group_size, min=1)
    v_args = {"v_states": v_states, "v_cache": v_cache, "v_scale_cache": v_scale_cache}
    has_v = [check_tensor(op, n, t, optional=True) for n, t in v_args.items()]
    if any(has_v) and not all(has_v):
        got = ", ".join(f"{n}={'None' if t is None else 'Tensor'}" for n, t in v_args.items())
        _fail(
            op,
            f"v_states, v_cache and v_scale_cache must be all None (K-only cache, e.g. MLA) or all tensors, got {got}",
        )
    ref = _check_kv_side(
        op, layout, group_size, k_states, k_cache, k_scale_cache, ("k_states", "k_cache", "k_scale_cache")
    )
    if all(has_v):
        assert v_states is not None and v_cache is not None and v_scale_cache is not None
        _check_kv_side(
            op, layout, group_size, v_states, v_cache, v_scale_cache, ("v_states", "v_cache", "v_scale_cache"), ref
        )
        check_dtype(op, "v_states", v_states, k_states.dtype)
        for kn, kt, vn, vt in (("k_cache", k_cache, "v_cache", v_cache),
                               ("k_scale_cache", k_scale_cache, "v_scale_cache", v_scale_cache)):  # fmt: skip
            if holds_data(kt) and holds_data(vt) and _share_an_element(kt, vt):
                _fail(op, f"{vn} must not share memory with {kn} (the V side would overwrite the K side)")
        if v_states.shape[1] != k_states.shape[1]:
            _fail(
                op,
                f"v_states.shape[1] (H_kv) must equal k_states.shape[1] = {k_states.shape[1]}, got {v_states.shape[1]}",
            )
    _tensor(op, "cu_seqlens_q", cu_seqlens_q, _INDEX, 1, "[B + 1]")
    if cu_seqlens_q.shape[0] < 1:
        _fail(op, f"cu_seqlens_q must have B + 1 >= 1 entries, got shape {_shape(cu_seqlens_q)}")
    B = cu_seqlens_q.shape[0] - 1
    _tensor(op, "kv_seqlens", kv_seqlens, _INDEX, 1, "[B]")
    check_shape(op, "kv_seqlens", kv_seqlens, (B,), "[B] (B = cu_seqlens_q.shape[0] - 1)")
    _tensor(op, "block_offsets", block_offsets, _INDEX, 2, "[B, max_blocks]")
    check_shape(op, "block_offsets", block_offsets, (B, None), "[B, max_blocks]")
    check_same_device(
        op,
        k_states=k_states,
        v_states=v_states,
        k_cache=k_cache,
        v_cache=v_cache,
        k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache,
        cu_seqlens_q=cu_seqlens_q,
        kv_seqlens=kv_seqlens,
        block_offsets=block_offsets,
    )
