"""The ``torch.ops.cute_moe.*`` custom ops.

Each op has

* a CPU implementation: input validation, then the pure-PyTorch reference
  (``cute_moe.reference.<op>_ref``), so every op runs on a machine with no GPU;
* a CUDA implementation: input validation, then the CuTe DSL kernel (inputs a
  kernel cannot take raise ``NotImplementedError`` or ``ValueError`` -- never a
  silent fallback to the reference);
* a fake (meta) implementation that computes every output shape and stride
  statically (``M_cap`` from ``reference.m_cap``, which works on SymInts), so
  ``torch.compile(fullgraph=True, dynamic=True)`` and CUDA graphs work. A fake
  names only the arguments it reads: the dispatcher passes the caller's
  arguments positionally but leaves out trailing ones left at their default,
  so a fake repeats the defaults of the arguments it reads.

``fused_moe`` and ``fused_moe_routed`` have one device-generic implementation
that composes the other ops (through ``call``: eagerly on CUDA the kernels'
implementations directly, otherwise the ops), so they run on every device.

Validation only reads metadata (never tensor data; the CPU implementations check the index data
they would index out of range with, ``check_index_range``, and the CUDA ones too under
``CUTE_MOE_DEBUG=1``).  The fake implementations check that all tensors share a device
(``check_same_device``: a call mixing meta and real tensors must raise, not return empty memory)
and the scalars their output shapes are computed from (a bad ``group_size`` or ``top_k`` must
raise, not give a shape).  Importing this module neither imports ``cutlass`` nor initialises
CUDA: kernels are imported lazily inside the CUDA implementations.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from cute_moe import launch_memo
from cute_moe import reference as R
from cute_moe import validation as V
from cute_moe.kernels.host_checks import check_index_range, debug_checks

__all__ = [
    "align",
    "fill_kv_cache_fp8",
    "finalize",
    "fused_moe",
    "fused_moe_routed",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_swiglu",
    "moe_reduce",
    "permute",
    "permute_quant",
    "quant_fp8",
    "route",
    "silu_mul_quant",
]

_NS = "cute_moe"
_FP8 = V.FP8_DTYPE
_G = V.ACT_GROUP_SIZE
_GEMM_SEGMENT_ALIGNMENT = 128  # the GPU GEMM's tile M: its segments must start on multiples of it
_MOE_ALIGNMENT = _GEMM_SEGMENT_ALIGNMENT  # row alignment fused_moe(_routed) uses for align()
# fused_moe_routed gets global expert ids, and the global expert count only as an optional hint;
# any id >= expert_offset + E_local is simply "not local", so it passes this bound to align.
_ANY_EXPERT = V.INT32_MAX


# ----------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------

_LIB = torch.library.Library(_NS, "DEF")


_PLAIN_CLASS = {"Tensor": Tensor, "int": int, "bool": bool, "float": float, "str": str}
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _Op:
    """One op registered through torch.library's low-level API.

    Same surface as ``torch.library.custom_op`` (``register_kernel``,
    ``register_fake``, calling it), without its Python autograd and dispatch
    wrappers, which cost tens of microseconds per eager call on the GPU path.
    The ops are inference-only: their outputs never require grad and no gradient flows through
    them.  The autograd key falls through (no cost at dispatch) and the CPU and composite
    implementations, which compute with torch ops, run under ``no_grad``.  Without that torch's
    fallback warned, then backpropagated wrong gradients (or failed on FP8 tensors).
    """

    def __init__(self, fn: Callable[..., Any], qualname: str, mutates_args: Any, device_types: Optional[str]):
        self.name = qualname.split("::")[1]
        _OPS[self.name] = self
        _LIB.define(self.name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        # No device type: a composition of other cute_moe ops, valid on every device.
        key = "CompositeExplicitAutograd" if device_types is None else device_types.upper()
        _LIB.impl(self.name, _without_grad(fn), key)
        _LIB.impl(self.name, torch.library.fallthrough_kernel, "Autograd")
        self.__wrapped__ = fn
        self.kernels: dict[str, Callable[..., Any]] = {}  # device type -> implementation, for tests
        self.arg_names = tuple(inspect.signature(fn).parameters)
        # (name, type, its plain Python class, optional) per schema argument, in order: what
        # ``check_arg_types`` checks.
        self.arg_types = []
        for a in getattr(torch.ops.cute_moe, self.name).default._schema.arguments:
            kind = str(a.type).removeprefix("Optional[").removesuffix("]")
            self.arg_types.append((a.name, kind, _PLAIN_CLASS.get(kind), str(a.type).startswith("Optional[")))

    def check_arg_types(self, args: tuple[Any, ...]) -> None:
        """TypeError naming the argument for a positional value the dispatcher would convert without
        a word (it takes ``True`` for an int, ``None`` for a bool as ``False``, ``2.7`` in a 0-d
        tensor as ``2``) or reject without naming it (``None`` for a tensor)."""
        for v, (name, kind, plain, optional) in zip(args, self.arg_types):
            if type(v) is plain or (v is None and optional):  # the common case, ~0.1 µs per argument
                continue
            if isinstance(v, _SYMBOLIC):  # traced outside dynamo (make_fx, AOT): the op's validation sees it
                continue
            if kind == "Tensor":
                V.check_tensor(self.name, name, v)
            elif kind == "int":
                V.check_int(self.name, name, v)
            elif kind == "bool":
                V.check_bool(self.name, name, v)
            elif kind == "float":
                V.check_float(self.name, name, v)
            elif kind == "str":
                V.check_str(self.name, name, v)

    def register_kernel(self, device_type: str, fn: Optional[Callable[..., Any]] = None) -> Any:
        """A CUDA implementation is registered behind the launch memo (``launch_memo.py``): eager
        calls whose argument metadata was seen before replay in C++ (through ``torch.ops``
        without entering Python).  The undecorated function
        is returned and stays what it was."""

        def register(impl: Callable[..., Any]) -> Callable[..., Any]:
            kernel = impl
            if device_type == "cuda":
                kernel = launch_memo.memoized(impl, f"{_NS}::{self.name}")
            _LIB.impl(self.name, kernel, device_type.upper())
            self.kernels[device_type] = kernel
            return impl

        return register if fn is None else register(fn)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The fake also serves meta tensors, and the dispatcher picks it whenever one argument is
        on ``meta``: a call mixing meta and real tensors (a module whose weights were never
        materialised) must raise there, not return ``empty`` memory."""

        @functools.wraps(fn)
        def fake(*args: Any, **kwargs: Any) -> Any:
            named = (*zip(self.arg_names, args), *kwargs.items())
            V.check_same_device(self.name, **{n: a for n, a in named if isinstance(a, Tensor)})
            return fn(*args, **kwargs)

        torch.library.register_fake(f"{_NS}::{self.name}", fake, lib=_LIB)
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(torch.ops.cute_moe, self.name)(*args, **kwargs)


def _without_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def _custom_op(qualname: str, *, mutates_args: Any, device_types: Optional[str] = None) -> Callable[..., _Op]:
    return lambda fn: _Op(fn, qualname, mutates_args, device_types)


def call(name: str, *args: Any) -> Any:
    """``torch.ops.cute_moe.<name>(*args)``; eagerly on a plain CUDA tensor, the op's CUDA
    implementation called directly (the function the dispatcher would pick, validation included):
    that saves the dispatcher's several microseconds per call at decode sizes.  Everything else
    goes through the op: torch.compile, torch.jit.trace, functorch transforms (vmap, grad),
    fake / meta / subclass tensors, active torch-function modes (also ``torch.device(...)``
    contexts) and dispatch modes.  The direct call records no profiler event for the op and
    ignores implementations a user registers on it later."""
    first = args[0]
    if (
        type(first) is Tensor
        and first.is_cuda
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch.jit.is_tracing()
    ):
        impl = _OPS[name].kernels.get("cuda")
        if impl is not None:
            return impl(*args)
    return dispatch(name, *args)


def dispatch(name: str, *args: Any) -> Any:
    """``torch.ops.cute_moe.<name>(*args)`` after ``_Op.check_arg_types``, while compiling too: the
    dispatcher converts a bad scalar (``None`` for a bool to ``False``, ``True`` for an int to 1)
    before the op's validation could see it, and the traced graph would run with the converted value."""
    op = _OPS[name]
    op.check_arg_types(args)
    if torch.compiler.is_compiling():
        return getattr(torch.ops.cute_moe, name)(*args)
    try:
        return getattr(torch.ops.cute_moe, name)(*args)
    except RuntimeError as e:
        # What the type check lets through and the schema refuses: a Python int past int64 (or past
        # a double's range, for a float), which torch reports as "found type 'int'" (of the type
        # 'int' or, for an optional argument, 'Optional[int]').
        refused = re.match(rf"cute_moe::{name}\(\) Expected a value of type '(?:Optional\[)?(\w+)\]?' for argument "
                           r"'(\w+)'", str(e))  # fmt: skip
        if refused is None:
            raise
        kind, arg = refused.groups()
        value = dict(zip((a[0] for a in op.arg_types), args)).get(arg)
        raise ValueError(f"cute_moe.{name}: {arg} must fit in a 64-bit {kind}, got {value}") from e


_OPS: dict[str, _Op] = {}  # name -> op, filled as the ops are defined


@functools.cache
def _launcher(module: str, name: str) -> Callable[..., Any]:
    """``cute_moe.kernels.<module>.<name>``, imported on the first CUDA call (the kernels import
    cutlass; the ops must not): later calls cost a cache hit, not an import statement's ~1 µs.
    The function is kept: patching the kernel module's attribute afterwards does not reach the op."""
    return getattr(importlib.import_module(f"cute_moe.kernels.{module}"), name)


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _empty_mn_major(like: Tensor, rows: Any, cols: Any) -> Tensor:
    """f32 [rows, cols] with strides (1, rows): the MN-major ("column-major") scale layout.  Not a
    view (``new_empty((cols, rows)).t()`` was one): the CPU implementations run under no_grad, and
    torch refuses in-place changes to a view made there once grad mode is back on."""
    # Strides as torch gives new_empty((cols, rows)).t(), the CUDA kernels' outputs: (1, max(rows, 1)).
    return like.new_empty_strided((rows, cols), (1, torch.sym_max(rows, 1)), dtype=torch.float32)


def _empty_scales(like: Tensor, rows: Any, cols: Any, mn_major: bool) -> Tensor:
    if mn_major:
        return _empty_mn_major(like, rows, cols)
    return like.new_empty((rows, cols), dtype=torch.float32)


def _check_non_decreasing(op: str, name: str, prefix_sums: Tensor) -> Tensor:
    """ValueError unless ``prefix_sums`` never decreases; returns the lengths it delimits (int64: an
    int32 difference could wrap and pass a decrease as a length)."""
    wide = prefix_sums.long()
    lengths = wide[1:] - wide[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cute_moe.{op}: {name} must be non-decreasing, got {prefix_sums.tolist()[:16]}")
    return lengths


def _check_segments(op: str, expert_offsets: Tensor, m_cap: int, expert_counts: Optional[Tensor] = None) -> None:
    """expert_offsets non-decreasing in [0, M_cap]; counts in [0, segment length]."""
    check_index_range(op, "expert_offsets", expert_offsets, 0, m_cap + 1)
    lengths = _check_non_decreasing(op, "expert_offsets", expert_offsets)
    if expert_counts is not None and bool(((expert_counts < 0) | (expert_counts > lengths)).any()):
        raise ValueError(f"cute_moe.{op}: expert_counts[e] must lie in [0, expert_offsets[e+1] - expert_offsets[e]]")


def _check_gather_maps(
    op: str, num_tokens: int, row_to_token: Tensor, expert_offsets: Tensor, token_to_row: Optional[Tensor] = None
) -> None:
    """permute(_quant)'s index data: row_to_token in [-1, T), token_to_row in [-1, M_cap), the segments."""
    check_index_range(op, "row_to_token", row_to_token, -1, num_tokens)
    check_index_range(op, "token_to_row", token_to_row, -1, row_to_token.shape[0])
    _check_segments(op, expert_offsets, row_to_token.shape[0])


def _as_scales(s: Tensor, mn_major: bool) -> Tensor:
    """``s`` in the layout the fake implementation promises, not a view (a copy only when needed)."""
    out = _empty_scales(s, s.shape[0], s.shape[1], mn_major)
    if out.stride() == s.stride() and s._base is None:
        return s
    return out.copy_(s)


# ----------------------------------------------------------------------------
# quant_fp8
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::quant_fp8", mutates_args=(), device_types="cpu")
def quant_fp8(
    x: Tensor, group_size: int = 128, scale_fmt: Optional[str] = None, column_major_scales: bool = False
) -> tuple[Tensor, Tensor]:
    V.validate_quant_fp8(x, group_size, scale_fmt, column_major_scales)
    q, s = R.quant_fp8_ref(x, group_size, scale_fmt, column_major_scales)
    return q.contiguous(), _as_scales(s, column_major_scales)


@quant_fp8.register_kernel("cuda")
def _quant_fp8_cuda(
    x: Tensor, group_size: int = 128, scale_fmt: Optional[str] = None, column_major_scales: bool = False
) -> tuple[Tensor, Tensor]:
    V.validate_quant_fp8(x, group_size, scale_fmt, column_major_scales)
    quant_fp8_cuda = _launcher("quant_fp8", "quant_fp8_cuda")

    return quant_fp8_cuda(x, group_size, scale_fmt, column_major_scales)


@quant_fp8.register_fake
def _quant_fp8_fake(
    x: Tensor, group_size: int = 128, scale_fmt: Optional[str] = None, column_major_scales: bool = False
) -> tuple[Tensor, Tensor]:
    # The scalars' rules, which the shapes below depend on (the shapes' own rules are the op's:
    # checking them here would guard on symbolic sizes).
    V.check_int("quant_fp8", "group_size", group_size, min=1)
    M, K = x.shape
    if isinstance(K, int):
        V.check_divisible("quant_fp8", "K (x.shape[1])", K, group_size, "group_size")
    return x.new_empty((M, K), dtype=_FP8), _empty_scales(x, M, K // group_size, column_major_scales)


# ----------------------------------------------------------------------------
# route
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::route", mutates_args=(), device_types="cpu")
def route(
    router_logits: Tensor,
    top_k: int,
    method: str,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    V.validate_route(router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor)
    _check_score_bias_values("route", score_bias)
    ids, w = R.route_ref(router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor)
    # clone, not .contiguous(): that keeps a sliced view's strides when T <= 1 (torch counts it as
    # contiguous), and the fake and the kernel give (k, 1).
    return ids.clone(memory_format=torch.contiguous_format), w.clone(memory_format=torch.contiguous_format)


def _check_score_bias_values(op: str, score_bias: Optional[Tensor]) -> None:
    """``V.check_bias_values`` where the data may be read: on the CPU, on CUDA under ``CUTE_MOE_DEBUG``."""
    if score_bias is not None and (not score_bias.is_cuda or debug_checks()):
        V.check_bias_values(op, "score_bias", score_bias)


@route.register_kernel("cuda")
def _route_cuda(
    router_logits: Tensor,
    top_k: int,
    method: str,
    score_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    V.validate_route(router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor)
    _check_score_bias_values("route", score_bias)
    route_cuda = _launcher("route", "route_cuda")

    if router_logits.dtype == torch.float16:  # the kernel reads f32 or bf16; fp16 -> f32 is exact
        router_logits = router_logits.float()
    return route_cuda(router_logits, top_k, method, score_bias, n_group, topk_group, routed_scaling_factor)


@route.register_fake
def _route_fake(router_logits: Tensor, top_k: int, *_: Any) -> tuple[Tensor, Tensor]:
    T, E = router_logits.shape
    V.check_int("route", "top_k", top_k, min=1, max=E if isinstance(E, int) else None,
                max_what="num_experts (router_logits.shape[1])")  # fmt: skip
    return (
        router_logits.new_empty((T, top_k), dtype=torch.int32),
        router_logits.new_empty((T, top_k), dtype=torch.float32),
    )


# ----------------------------------------------------------------------------
# align
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::align", mutates_args=(), device_types="cpu")
def align(
    topk_ids: Tensor,
    num_experts: int,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    V.validate_align(topk_ids, num_experts, alignment, expert_offset, num_local_experts)
    outs = R.align_ref(topk_ids, num_experts, alignment, expert_offset, num_local_experts)
    return tuple(o.contiguous() for o in outs)  # type: ignore[return-value]


@align.register_kernel("cuda")
def _align_cuda(
    topk_ids: Tensor,
    num_experts: int,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    V.validate_align(topk_ids, num_experts, alignment, expert_offset, num_local_experts)
    align_cuda = _launcher("align", "align_cuda")
    if num_experts != _ANY_EXPERT and debug_checks():  # (_ANY_EXPERT: fused_moe_routed's ids, all legal)
        check_index_range("align", "topk_ids", topk_ids, -1, num_experts)
    return align_cuda(topk_ids, num_experts, alignment, expert_offset, num_local_experts)


@align.register_fake
def _align_fake(
    topk_ids: Tensor,
    num_experts: int,
    alignment: int = 128,
    expert_offset: int = 0,
    num_local_experts: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    V.check_align_sizes(num_experts, alignment, num_local_experts)
    T, k = topk_ids.shape
    e_local = num_experts if num_local_experts is None else num_local_experts
    m_cap = R.m_cap(T, k, e_local, alignment)
    new = topk_ids.new_empty
    return (
        new((e_local + 1,), dtype=torch.int32),
        new((m_cap,), dtype=torch.int32),
        new((T, k), dtype=torch.int32),
        new((e_local,), dtype=torch.int32),
    )


# ----------------------------------------------------------------------------
# permute_quant / permute
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::permute_quant", mutates_args=(), device_types="cpu")
def permute_quant(
    x: Tensor,
    row_to_token: Tensor,
    expert_offsets: Tensor,
    scale_fmt: Optional[str] = None,
    token_to_row: Optional[Tensor] = None,
    zero_padding: bool = True,
) -> tuple[Tensor, Tensor]:
    V.validate_permute_quant(x, row_to_token, expert_offsets, scale_fmt, token_to_row, zero_padding)
    _check_gather_maps("permute_quant", x.shape[0], row_to_token, expert_offsets, token_to_row)
    a, s = R.permute_quant_ref(x, row_to_token, expert_offsets, scale_fmt, token_to_row)
    return a.contiguous(), _as_scales(s, True)


@permute_quant.register_kernel("cuda")
def _permute_quant_cuda(
    x: Tensor,
    row_to_token: Tensor,
    expert_offsets: Tensor,
    scale_fmt: Optional[str] = None,
    token_to_row: Optional[Tensor] = None,
    zero_padding: bool = True,
) -> tuple[Tensor, Tensor]:
    V.validate_permute_quant(x, row_to_token, expert_offsets, scale_fmt, token_to_row, zero_padding)
    permute_quant_cuda = _launcher("permute_quant", "permute_quant_cuda")
    if debug_checks():
        _check_gather_maps("permute_quant", x.shape[0], row_to_token, expert_offsets, token_to_row)

    # With token_to_row: the token-major kernel (x read once); without: the row-major one.
    return permute_quant_cuda(x, row_to_token, expert_offsets, scale_fmt, token_to_row, zero_padding)


def _permuted_fake(like: Tensor, row_to_token: Tensor) -> tuple[Tensor, Tensor]:
    m_cap, H = row_to_token.shape[0], like.shape[1]
    return like.new_empty((m_cap, H), dtype=_FP8), _empty_mn_major(like, m_cap, H // _G)


@permute_quant.register_fake
def _permute_quant_fake(x: Tensor, row_to_token: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    return _permuted_fake(x, row_to_token)


@_custom_op(f"{_NS}::permute", mutates_args=(), device_types="cpu")
def permute(a_in: Tensor, a_in_scale: Tensor, row_to_token: Tensor, expert_offsets: Tensor) -> tuple[Tensor, Tensor]:
    V.validate_permute(a_in, a_in_scale, row_to_token, expert_offsets)
    _check_gather_maps("permute", a_in.shape[0], row_to_token, expert_offsets)
    a, s = R.permute_ref(a_in, a_in_scale, row_to_token, expert_offsets)
    return a.contiguous(), _as_scales(s, True)


@permute.register_kernel("cuda")
def _permute_cuda(
    a_in: Tensor, a_in_scale: Tensor, row_to_token: Tensor, expert_offsets: Tensor
) -> tuple[Tensor, Tensor]:
    V.validate_permute(a_in, a_in_scale, row_to_token, expert_offsets)
    permute_cuda = _launcher("permute_quant", "permute_cuda")
    if debug_checks():
        _check_gather_maps("permute", a_in.shape[0], row_to_token, expert_offsets)

    return permute_cuda(a_in, a_in_scale, row_to_token, expert_offsets)


@permute.register_fake
def _permute_fake(a_in: Tensor, a_in_scale: Tensor, row_to_token: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    return _permuted_fake(a_in, row_to_token)


# ----------------------------------------------------------------------------
# grouped_gemm_fp8
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::grouped_gemm_fp8", mutates_args=(), device_types="cpu")
def grouped_gemm_fp8(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    expected_m: Optional[int] = None,
) -> Tensor:
    V.validate_grouped_gemm_fp8(a, a_scale, b, b_scale, expert_offsets, expert_counts, expected_m)
    _check_segments("grouped_gemm_fp8", expert_offsets, a.shape[0], expert_counts)
    return R.grouped_gemm_fp8_ref(a, a_scale, b, b_scale, expert_offsets, expert_counts).contiguous()


@grouped_gemm_fp8.register_kernel("cuda")
def _grouped_gemm_fp8_cuda(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    expected_m: Optional[int] = None,
) -> Tensor:
    V.validate_grouped_gemm_fp8(a, a_scale, b, b_scale, expert_offsets, expert_counts, expected_m)
    grouped_gemm_fp8_cuda = _launcher("grouped_gemm", "grouped_gemm_fp8_cuda")
    if debug_checks():
        _check_gemm_segments("grouped_gemm_fp8", expert_offsets, a.shape[0], expert_counts)
    return grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets, expert_counts, expected_m)


def _check_gemm_segments(op: str, expert_offsets: Tensor, m_cap: int, expert_counts: Optional[Tensor]) -> None:
    """CUTE_MOE_DEBUG's checks of the GEMM's segments (a host sync): ``_check_segments``, and the
    GPU kernel's 128-row alignment, whose breach it writes as NaN tiles."""
    _check_segments(op, expert_offsets, m_cap, expert_counts)
    if bool((expert_offsets % _GEMM_SEGMENT_ALIGNMENT != 0).any()):
        raise ValueError(f"cute_moe.{op}: expert_offsets must be multiples of {_GEMM_SEGMENT_ALIGNMENT} on the GPU "
                         f"(align(..., alignment=128)); the kernel writes a misaligned segment's tiles as NaN, got "
                         f"{expert_offsets.tolist()[:16]}")  # fmt: skip


@grouped_gemm_fp8.register_fake
def _grouped_gemm_fp8_fake(a: Tensor, a_scale: Tensor, b: Tensor, *_: Any) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------
# grouped_gemm_fp8_swiglu: the w13 GEMM with silu_mul_quant in its epilogue
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::grouped_gemm_fp8_swiglu", mutates_args=(), device_types="cpu")
def grouped_gemm_fp8_swiglu(
    a: Tensor,
    a_scale: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expected_m: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    V.validate_grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first, scale_fmt,
                                       expected_m)  # fmt: skip
    _check_segments("grouped_gemm_fp8_swiglu", expert_offsets, a.shape[0], expert_counts)
    a2, s = R.grouped_gemm_fp8_swiglu_ref(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first,
                                          scale_fmt)  # fmt: skip
    return a2.contiguous(), _as_scales(s, True)


@grouped_gemm_fp8_swiglu.register_kernel("cuda")
def _grouped_gemm_fp8_swiglu_cuda(
    a: Tensor,
    a_scale: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    expert_offsets: Tensor,
    expert_counts: Optional[Tensor] = None,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expected_m: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    V.validate_grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first, scale_fmt,
                                       expected_m)  # fmt: skip
    swiglu_cuda = _launcher("grouped_gemm_swiglu", "grouped_gemm_fp8_swiglu_cuda")
    if debug_checks():
        _check_gemm_segments("grouped_gemm_fp8_swiglu", expert_offsets, a.shape[0], expert_counts)
    return swiglu_cuda(a, a_scale, w13, w13_scale, expert_offsets, expert_counts, gate_first, scale_fmt, expected_m)


@grouped_gemm_fp8_swiglu.register_fake
def _grouped_gemm_fp8_swiglu_fake(a: Tensor, a_scale: Tensor, w13: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    m_cap, inter = a.shape[0], w13.shape[1] // 2
    return a.new_empty((m_cap, inter), dtype=_FP8), _empty_mn_major(a, m_cap, inter // _G)


# ----------------------------------------------------------------------------
# silu_mul_quant
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::silu_mul_quant", mutates_args=(), device_types="cpu")
def silu_mul_quant(
    h: Tensor,
    expert_offsets: Tensor,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expert_counts: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    V.validate_silu_mul_quant(h, expert_offsets, gate_first, scale_fmt, expert_counts)
    _check_segments("silu_mul_quant", expert_offsets, h.shape[0], expert_counts)
    a2, s = R.silu_mul_quant_ref(h, expert_offsets, gate_first, scale_fmt, expert_counts)
    return a2.contiguous(), _as_scales(s, True)


@silu_mul_quant.register_kernel("cuda")
def _silu_mul_quant_cuda(
    h: Tensor,
    expert_offsets: Tensor,
    gate_first: bool = True,
    scale_fmt: Optional[str] = None,
    expert_counts: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    V.validate_silu_mul_quant(h, expert_offsets, gate_first, scale_fmt, expert_counts)
    silu_mul_quant_cuda = _launcher("silu_mul_quant", "silu_mul_quant_cuda")
    if debug_checks():
        _check_segments("silu_mul_quant", expert_offsets, h.shape[0], expert_counts)

    # With expert_counts: padding rows neither read nor written (their codes and scales unspecified).
    return silu_mul_quant_cuda(h, expert_offsets, gate_first, scale_fmt, expert_counts)


@silu_mul_quant.register_fake
def _silu_mul_quant_fake(h: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    m_cap, inter = h.shape[0], h.shape[1] // 2
    return h.new_empty((m_cap, inter), dtype=_FP8), _empty_mn_major(h, m_cap, inter // _G)


# ----------------------------------------------------------------------------
# finalize / moe_reduce
# ----------------------------------------------------------------------------


@_custom_op(f"{_NS}::finalize", mutates_args=(), device_types="cpu")
def finalize(y: Tensor, topk_weights: Tensor, token_to_row: Tensor) -> Tensor:
    V.validate_finalize(y, topk_weights, token_to_row)
    check_index_range("finalize", "token_to_row", token_to_row, -1, y.shape[0])
    return R.finalize_ref(y, topk_weights, token_to_row).contiguous()


@finalize.register_kernel("cuda")
def _finalize_cuda(y: Tensor, topk_weights: Tensor, token_to_row: Tensor) -> Tensor:
    V.validate_finalize(y, topk_weights, token_to_row)
    finalize_cuda = _launcher("finalize", "finalize_cuda")

    return finalize_cuda(y, topk_weights, token_to_row)


@finalize.register_fake
def _finalize_fake(y: Tensor, topk_weights: Tensor, *_: Any) -> Tensor:
    return y.new_empty((topk_weights.shape[0], y.shape[1]), dtype=torch.bfloat16)


@_custom_op(f"{_NS}::moe_reduce", mutates_args=(), device_types="cpu")
def moe_reduce(hidden: Tensor, weights: Tensor, fp32_acc: bool = False) -> Tensor:
    V.validate_moe_reduce(hidden, weights, fp32_acc)
    return R.moe_reduce_ref(hidden, weights, fp32_acc).contiguous()


@moe_reduce.register_kernel("cuda")
def _moe_reduce_cuda(hidden: Tensor, weights: Tensor, fp32_acc: bool = False) -> Tensor:
    V.validate_moe_reduce(hidden, weights, fp32_acc)
    moe_reduce_cuda = _launcher("moe_reduce", "moe_reduce_cuda")

    return moe_reduce_cuda(hidden, weights, fp32_acc)


@moe_reduce.register_fake
def _moe_reduce_fake(hidden: Tensor, *_: Any) -> Tensor:
    return hidden.new_empty((hidden.shape[0], hidden.shape[2]))


# ----------------------------------------------------------------------------
# fused_moe_routed / fused_moe: one device-generic composition of the ops above
# ----------------------------------------------------------------------------


def _check_align_limits(op: str, x: Tensor, top_k: int, e_local: int) -> None:
    """NotImplementedError naming ``op`` where ``align``'s CUDA kernel cannot take the layer's
    routing (T * k over its limit): raised before the layer's first launch, not from align's
    launcher halfway through it."""
    T = x.shape[0]
    if x.device.type != "cuda" or T == 0 or top_k == 0:
        return
    reason = _launcher("align", "AlignKernel").can_implement(top_k, e_local, _MOE_ALIGNMENT, T)
    if reason is not None:
        raise NotImplementedError(f"cute_moe.{op}: no CUDA kernel for this input (align's): {reason}")


def _moe_from_topk(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    num_experts: int,
    expert_offset: int,
    gate_first: bool,
    act_scale_fmt: Optional[str],
    weight_on_input: bool,
    routed_experts: Optional[int],
) -> Tensor:
    """``num_experts``: align's bound on the ids; ``routed_experts``: the global expert count where
    known (fused_moe_routed may not know it)."""
    e_local = w13.shape[0]
    T, k = topk_ids.shape
    # Rows per expert under even routing, for the GEMMs' launch rule: M_cap cannot tell it on an
    # expert-parallel slice (sized for every routed row).
    expected_m = None if routed_experts is None else T * k // routed_experts
    topk_weights = topk_weights.float()  # finalize takes f32; 16-bit weights convert exactly
    if weight_on_input:
        # HF Llama-4's convention (vLLM's apply_router_weight_on_input): expert j of token t sees
        # x[t] * w[t, j], w rounded to x's dtype first, as both compute it. Each slot becomes a token
        # of its own (k scaled copies of x when k > 1), and finalize sums a token's k rows unweighted.
        x = (x[:, None, :] * topk_weights.to(x.dtype)[:, :, None]).reshape(T * k, x.shape[1])
        topk_ids = topk_ids.reshape(T * k, 1)
        topk_weights = torch.ones_like(topk_weights)
    if topk_ids.is_cuda:
        offsets, row_to_token, token_to_row, counts = call(
            "align", topk_ids, num_experts, _MOE_ALIGNMENT, expert_offset, e_local
        )
    else:
        # align's CPU implementation refuses ids outside [-1, num_experts); the layer's rule is the GPU
        # kernel's: any id outside the local range (fused_moe_routed's are unbounded) is not local.
        offsets, row_to_token, token_to_row, counts = R.align_local(topk_ids, e_local, _MOE_ALIGNMENT, expert_offset)
    # Padding rows are unspecified: both GEMMs and the SwiGLU step are given the counts and skip them
    # (the 256-wide SwiGLU kernel writes whole tiles, padding rows included; nothing reads them).
    a, a_scale = call("permute_quant", x, row_to_token, offsets, act_scale_fmt, token_to_row, False)
    a2, a2_scale = call("grouped_gemm_fp8_swiglu", a, a_scale, w13, w13_scale, offsets, counts, gate_first,
                        act_scale_fmt, expected_m)  # fmt: skip
    y = call("grouped_gemm_fp8", a2, a2_scale, w2, w2_scale, offsets, counts, expected_m)
    out = call("finalize", y, topk_weights, token_to_row.reshape(T, k))
    # finalize writes bf16; fp16 hidden states get one conversion pass (bf16's 8 mantissa bits are
    # far below the FP8 activations' error)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


@_custom_op(f"{_NS}::fused_moe_routed", mutates_args=())
def fused_moe_routed(
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
) -> Tensor:
    on_input = V.validate_fused_moe_routed(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_offset, gate_first, act_scale_fmt,
        apply_router_weight_on_input, num_experts,
    )  # fmt: skip
    _check_align_limits("fused_moe_routed", x, topk_ids.shape[1], w13.shape[0])
    return _moe_from_topk(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, _ANY_EXPERT, expert_offset, gate_first, act_scale_fmt,
        on_input, num_experts,
    )  # fmt: skip


@fused_moe_routed.register_fake
def _fused_moe_routed_fake(x: Tensor, *_: Any) -> Tensor:
    return x.new_empty(x.shape)


@_custom_op(f"{_NS}::fused_moe", mutates_args=())
def fused_moe(
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
) -> Tensor:
    on_input = V.validate_fused_moe(
        x, router_logits, w13, w13_scale, w2, w2_scale, top_k, routing_method, score_bias, n_group, topk_group,
        routed_scaling_factor, expert_offset, num_experts, gate_first, act_scale_fmt, apply_router_weight_on_input,
    )  # fmt: skip
    _check_align_limits("fused_moe", x, top_k, w13.shape[0])
    if not x.is_cuda:  # (on CUDA route's own debug check runs; the flag's read costs ~0.7 µs)
        _check_score_bias_values("fused_moe", score_bias)
    ids, w = call("route", router_logits, top_k, routing_method, score_bias, n_group, topk_group, routed_scaling_factor)
    e_global = router_logits.shape[1]
    return _moe_from_topk(
        x, ids, w, w13, w13_scale, w2, w2_scale, e_global, expert_offset, gate_first, act_scale_fmt, on_input, e_global
    )


@fused_moe.register_fake
def _fused_moe_fake(x: Tensor, *_: Any) -> Tensor:
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------
# fill_kv_cache_fp8 (mutates the caches)
# ----------------------------------------------------------------------------


@_custom_op(
    f"{_NS}::fill_kv_cache_fp8",
    mutates_args=("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"),
    device_types="cpu",
)
def fill_kv_cache_fp8(
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
    V.validate_fill_kv_cache_fp8(
        k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache, cu_seqlens_q, kv_seqlens, block_offsets,
        group_size, scale_fmt, layout,
    )  # fmt: skip
    _check_non_decreasing("fill_kv_cache_fp8", "cu_seqlens_q", cu_seqlens_q)
    R.fill_kv_cache_fp8_ref(
        k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache, cu_seqlens_q, kv_seqlens, block_offsets,
        group_size, scale_fmt, layout,
    )  # fmt: skip


@fill_kv_cache_fp8.register_kernel("cuda")
def _fill_kv_cache_fp8_cuda(
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
    args = (
        k_states, v_states, k_cache, v_cache, k_scale_cache, v_scale_cache, cu_seqlens_q, kv_seqlens, block_offsets,
        group_size, scale_fmt, layout,
    )  # fmt: skip
    V.validate_fill_kv_cache_fp8(*args)
    if debug_checks():
        _check_non_decreasing("fill_kv_cache_fp8", "cu_seqlens_q", cu_seqlens_q)
    fill_kv_cache_fp8_cuda = _launcher("fill_kv_cache_fp8", "fill_kv_cache_fp8_cuda")

    fill_kv_cache_fp8_cuda(*args)


@fill_kv_cache_fp8.register_fake
def _fill_kv_cache_fp8_fake(*_: Any) -> None:
    return None
