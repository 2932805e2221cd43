"""The launch memo (cute_moe/launch_memo.py) on CPU tensors: record, replay, and every case it must
not replay.  The "kernels" are TVM-FFI functions made from Python callables that compute with
numpy (no aten op, so the recorder sees only what the op's host code does), called through
``compiler.CompiledKernel`` exactly as the compiled DSL kernels are."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from cute_moe import launch_memo
from cute_moe.compiler import CompiledKernel

tvm_ffi = pytest.importorskip("tvm_ffi")



@pytest.fixture(scope="module", autouse=True)
def extension():
    try:
        return launch_memo.load_extension()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"the launch memo's extension does not build here: {e}")


class _PyKernel:
    """A TVM-FFI function from a Python callable, shaped like the DSL's compiled functions."""

    def __init__(self, fn):
        self.ffi = tvm_ffi.convert(fn)

    def __tvm_ffi_object__(self):
        return self.ffi

    def __call__(self, *args):
        return self.ffi(*args)


def _np(t):
    """A numpy view of a TVM-FFI tensor argument (one passed by DLTensor pointer has no DLPack
    export of its own)."""
    dtype = np.dtype(str(t.dtype))
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.strides)) if all(t.shape) else 0
    flat = np.ctypeslib.as_array((ctypes.c_byte * (span * dtype.itemsize)).from_address(t.data_ptr()))
    return np.lib.stride_tricks.as_strided(
        flat.view(dtype), t.shape, tuple(s * dtype.itemsize for s in t.strides), writeable=True
    )


def _axpy(x, y, out, alpha):  # out = alpha * x + y, in float32
    o = _np(out)
    o[...] = alpha * _np(x).astype(np.float32) + _np(y).astype(np.float32)


AXPY = CompiledKernel(_PyKernel(_axpy), 4)


def _axpy_op(x, y, alpha):
    """The shape of an op's CUDA implementation: checks, an allocation, one kernel call."""
    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"axpy: x and y must be 2-D of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
    AXPY(x, y, out, alpha)
    return out


def _entries():
    return launch_memo.stats()[0]


def _memo(impl):
    return launch_memo.memoized(impl)


def test_replay_computes_on_new_data_into_new_outputs():
    op = _memo(_axpy_op)
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    first = op(x, y, 2.0)
    plans, hits, _ = launch_memo.stats()
    for _ in range(3):
        x, y = torch.randn(5, 7), torch.randn(5, 7)
        out = op(x, y, 2.0)
        assert out.data_ptr() != first.data_ptr()
        assert out.shape == (5, 7) and out.stride() == (7, 1) and out.dtype == torch.float32
        torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)
    assert launch_memo.stats()[:2] == (plans, hits + 3)


@pytest.mark.parametrize(
    "change",
    ["shape", "dtype", "strides", "alignment", "scalar", "scalar_type"],
)
def test_other_metadata_is_a_miss(change):
    op = _memo(_axpy_op)
    base = torch.randn(6, 8)
    op(base, torch.randn(6, 8), 1.5)
    hits = launch_memo.stats()[1]
    x, y, alpha = torch.randn(6, 8), torch.randn(6, 8), 1.5
    if change == "shape":
        x, y = torch.randn(6, 4), torch.randn(6, 4)
    elif change == "dtype":
        x = torch.randn(6, 8, dtype=torch.float64)
    elif change == "strides":
        x = torch.randn(8, 6).t()
    elif change == "alignment":  # one element in: 4-byte aligned
        x = torch.randn(6 * 8 + 1)[1:].view(6, 8)
    elif change == "scalar":
        alpha = -0.5
    elif change == "scalar_type":  # 1.5 -> 1.5 as int is impossible: 2.0 (float) was seen, 2 (int) not
        alpha = 2
        op(torch.randn(6, 8), torch.randn(6, 8), 2.0)
        hits = launch_memo.stats()[1]
    out = op(x, y, alpha)
    assert launch_memo.stats()[1] == hits
    torch.testing.assert_close(out, (alpha * x.float() + y).float(), rtol=0, atol=0)
    # and that metadata now replays
    x2 = x.clone() if change != "strides" else torch.randn(8, 6).t()
    if change == "alignment":
        x2 = torch.randn(6 * 8 + 1)[1:].view(6, 8)
    out = op(x2, y, alpha)
    assert launch_memo.stats()[1] == hits + 1
    torch.testing.assert_close(out, (alpha * x2.float() + y).float(), rtol=0, atol=0)


def test_bad_input_raises_every_time_and_is_not_recorded():
    op = _memo(_axpy_op)
    plans = _entries()
    for _ in range(2):
        with pytest.raises(ValueError, match="x and y must be 2-D of one shape"):
            op(torch.randn(3, 4), torch.randn(4, 3), 1.0)
    assert _entries() == plans


def test_host_code_beyond_allocations_and_views_is_never_replayed():
    recorded = []

    def op_with_copy(x, y, alpha):
        recorded.append(launch_memo.recording() is not None)
        return _axpy_op(x.contiguous(), y, alpha)  # a copy when x is not contiguous

    op = _memo(op_with_copy)
    hits = launch_memo.stats()[1]
    for _ in range(3):
        x, y = torch.randn(7, 5).t(), torch.randn(5, 7)
        torch.testing.assert_close(op(x, y, 1.0), x + y, rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits
    assert recorded == [True, False, False]  # the first call's failure is remembered


def test_inputs_sharing_storage_replay_only_with_the_same_aliasing():
    op = _memo(_axpy_op)
    buf = torch.randn(3, 4, 4)
    torch.testing.assert_close(op(buf[0], buf[1], 1.0), buf[0] + buf[1], rtol=0, atol=0)  # records
    hits = launch_memo.stats()[1]
    buf = torch.randn(3, 4, 4)
    torch.testing.assert_close(op(buf[0], buf[1], 1.0), buf[0] + buf[1], rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits + 1
    torch.testing.assert_close(op(buf[1], buf[2], 1.0), buf[1] + buf[2], rtol=0, atol=0)  # same distance
    assert launch_memo.stats()[1] == hits + 2
    for x, y in ((buf[0], buf[2]), (buf[0], buf[0]), (buf[1], buf[0]), (torch.randn(4, 4), torch.randn(4, 4))):
        torch.testing.assert_close(op(x, y, 1.0), x + y, rtol=0, atol=0)  # other aliasing: a miss
    assert launch_memo.stats()[1] == hits + 2


def test_recorded_separately_then_replayed_on_shared_storage():
    op = _memo(_axpy_op)
    op(torch.randn(4, 4), torch.randn(4, 4), 1.0)
    hits = launch_memo.stats()[1]
    buf = torch.randn(2, 4, 4)
    torch.testing.assert_close(op(buf[0], buf[1], 1.0), buf[0] + buf[1], rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits  # aliasing is part of the key


def _rowsum(x, out):  # out[i] = sum of x's row i (x as uint8 bytes of float32 values)
    _np(out)[:, 0] = _np(x).view(np.float32).sum(axis=1)


ROWSUM = CompiledKernel(_PyKernel(_rowsum), 2)


def test_views_dtype_views_offsets_and_result_views():
    def op_views(x):
        # a byte view of rows 1.. (an offset into the input), and a result that is a view
        # (the transpose of the allocation), returned beside the allocation itself
        col = torch.empty(1, x.shape[0] - 1, dtype=torch.float32)
        ROWSUM(x[1:].view(torch.uint8), col.t())
        return col.t(), col

    op = _memo(op_views)
    op(torch.randn(6, 4))
    hits = launch_memo.stats()[1]
    x = torch.randn(6, 4)
    colt, col = op(x)
    assert launch_memo.stats()[1] == hits + 1
    assert colt.shape == (5, 1) and col.shape == (1, 5) and colt.data_ptr() == col.data_ptr()
    torch.testing.assert_close(colt[:, 0], x[1:].sum(1), rtol=1e-6, atol=1e-6)


def _scale_rows(y, s):  # y[i, :] *= s[i], in place
    _np(y)[...] *= _np(s)[:, None]


SCALE_ROWS = CompiledKernel(_PyKernel(_scale_rows), 2)


def test_an_op_that_mutates_its_input_and_returns_none():
    def op_inplace(y, s):
        SCALE_ROWS(y, s)

    op = _memo(op_inplace)
    op(torch.randn(3, 5), torch.randn(3))
    hits = launch_memo.stats()[1]
    y, s = torch.randn(3, 5), torch.randn(3)
    expect = y * s[:, None]
    assert op(y, s) is None
    assert launch_memo.stats()[1] == hits + 1
    torch.testing.assert_close(y, expect, rtol=0, atol=0)


def test_as_strided_from_the_storage_start_is_not_replayed():
    def op_rebased(x, y, alpha):  # a view placed by storage offset 0, not by x's own offset
        return _axpy_op(x.as_strided(x.shape, x.stride(), 0), y, alpha)

    op = _memo(op_rebased)
    buf = torch.randn(2, 3, 3)
    op(buf[1], torch.randn(3, 3), 1.0)
    hits = launch_memo.stats()[1]
    buf, y = torch.randn(2, 3, 3), torch.randn(3, 3)
    torch.testing.assert_close(op(buf[1], y, 1.0), buf[0] + y, rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits


def test_an_unrecordable_result_leaves_the_call_alone():
    def op_int_view(x, y, alpha):
        return _axpy_op(x, y, alpha).view(torch.int32)  # a result of another dtype than its allocation

    op = _memo(op_int_view)
    hits = launch_memo.stats()[1]
    for _ in range(2):
        x, y = torch.randn(2, 2), torch.randn(2, 2)
        torch.testing.assert_close(op(x, y, 1.0), (x + y).view(torch.int32), rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits


def test_a_call_that_compiled_is_recorded_again_next_time():
    recorded = []

    def op_compiling(x, y, alpha):
        recorded.append(launch_memo.recording() is not None)
        if len(recorded) == 1:
            launch_memo.recording().compiled = True  # what compiler.compile_kernel does
        return _axpy_op(x, y, alpha)

    op = _memo(op_compiling)
    hits = launch_memo.stats()[1]
    for _ in range(3):
        op(torch.randn(2, 5), torch.randn(2, 5), 1.0)
    assert recorded == [True, True]  # the first call compiled, the second recorded, the third replayed
    assert launch_memo.stats()[1] == hits + 1


def _raise_index_error(x, out):
    raise IndexError("no such row")


def _op_failing_on_demand():
    """An op whose kernel raises IndexError once ``fail["on"]`` is set, and that switch."""
    fail = {"on": False}
    kernel = CompiledKernel(_PyKernel(lambda x, out: _raise_index_error(x, out) if fail["on"] else None), 2)

    def op_may_fail(x):
        out = torch.empty(x.shape[0], x.shape[1])
        kernel(x, out)
        return out

    return op_may_fail, fail


def test_a_kernel_error_has_the_same_type_in_a_replay():
    op_may_fail, fail = _op_failing_on_demand()
    op = _memo(op_may_fail)
    op(torch.randn(2, 2))
    fail["on"] = True
    hits = launch_memo.stats()[1]
    with pytest.raises(IndexError, match="no such row"):
        op(torch.randn(2, 2))
    assert launch_memo.stats()[1] == hits + 1


def test_debug_mode_is_never_replayed(monkeypatch):
    op = _memo(_axpy_op)
    op(torch.randn(2, 3), torch.randn(2, 3), 1.0)
    monkeypatch.setenv("CUTE_MOE_DEBUG", "1")
    hits = launch_memo.stats()[1]
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(op(x, y, 1.0), x + y, rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits


def test_unhandled_arguments_take_the_python_path():
    calls = []

    def op_list(x, sizes):
        calls.append(sizes)
        return _axpy_op(x, x.clone(), 1.0)

    op = _memo(op_list)
    for _ in range(2):
        op(torch.randn(2, 2), [1, 2])
    assert len(calls) == 2


def test_the_ops_cuda_implementations_are_memoized_and_replayed_from_the_dispatcher():
    from cute_moe import ops

    assert launch_memo.active()  # loaded: the dispatcher kernels are registered
    for name, op in ops._OPS.items():
        cuda = op.kernels.get("cuda")
        if cuda is not None:
            assert cuda.__wrapped__.__name__.endswith("_cuda"), name
            assert "BackendSelect: registered" in torch._C._dispatch_dump(f"cute_moe::{name}"), name


# Calls through the dispatcher (torch.ops): a kernel on the op's BackendSelect key replays them
# without entering Python.  Each op here counts the calls that reach its Python kernel.
_TEST_LIB = torch.library.Library("cute_moe_memo_test", "DEF")


def _dispatched_op(name, schema, impl):
    calls = []
    _TEST_LIB.define(name + schema)
    memo = launch_memo.memoized(impl, f"cute_moe_memo_test::{name}", "CPU")

    def kernel(*args):
        calls.append(args)
        return memo(*args)

    _TEST_LIB.impl(name, kernel, "CPU")
    return getattr(torch.ops.cute_moe_memo_test, name), calls


def test_dispatcher_calls_replay_without_python_with_trailing_defaults_as_python_sees_them():
    def axpy(x, y, alpha=1.0):
        return _axpy_op(x, y, alpha)

    op, calls = _dispatched_op("axpy", "(Tensor x, Tensor y, float alpha=1.0) -> Tensor", axpy)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(op(x, y), x + y, rtol=0, atol=0)  # records (the Python kernel)
    assert len(calls) == 1 and len(calls[0]) == 2  # torch leaves the default out
    hits = launch_memo.stats()[1]
    for alpha in (None, 1.0):  # alpha left at its default either way: one key
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        out = op(x, y) if alpha is None else op(x, y, alpha)
        torch.testing.assert_close(out, x + y, rtol=0, atol=0)
    assert len(calls) == 1 and launch_memo.stats()[1] == hits + 2
    out = op(x, y, 2.5)  # another key: recorded through Python, then replayed
    out = op(x, y, 2.5)
    torch.testing.assert_close(out, 2.5 * x + y, rtol=0, atol=0)
    assert len(calls) == 2 and launch_memo.stats()[1] == hits + 3
    w = torch.nn.Parameter(torch.randn(3, 4), requires_grad=False)  # a Parameter is keyed apart
    with torch.no_grad():
        torch.testing.assert_close(op(w, y), w + y, rtol=0, atol=0)
        torch.testing.assert_close(op(w, y), w + y, rtol=0, atol=0)
    assert len(calls) == 3 and launch_memo.stats()[1] == hits + 4
    with pytest.raises(ValueError, match="x and y must be 2-D of one shape"):  # bad input: Python's error
        op(torch.randn(3, 4), torch.randn(4, 3))
    assert len(calls) == 4


def test_dispatcher_replays_tuples_and_in_place_ops_and_stops_when_switched_off():
    def op_views(x):
        col = torch.empty(1, x.shape[0] - 1, dtype=torch.float32)
        ROWSUM(x[1:].view(torch.uint8), col.t())
        return col.t(), col

    def op_inplace(y, s):
        SCALE_ROWS(y, s)

    views, view_calls = _dispatched_op("rowsum_views", "(Tensor x) -> (Tensor, Tensor)", op_views)
    scale, scale_calls = _dispatched_op("scale_rows", "(Tensor(a!) y, Tensor s) -> ()", op_inplace)
    views(torch.randn(6, 4))
    scale(torch.randn(3, 5), torch.randn(3))
    x = torch.randn(6, 4)
    colt, col = views(x)
    assert colt.shape == (5, 1) and col.shape == (1, 5) and colt.data_ptr() == col.data_ptr()
    torch.testing.assert_close(colt[:, 0], x[1:].sum(1), rtol=1e-6, atol=1e-6)
    y, s = torch.randn(3, 5), torch.randn(3)
    expect = y * s[:, None]
    assert scale(y, s) is None
    torch.testing.assert_close(y, expect, rtol=0, atol=0)
    assert len(view_calls) == 1 and len(scale_calls) == 1
    launch_memo.set_enabled(False)
    try:
        views(x)
        assert len(view_calls) == 2
    finally:
        launch_memo.set_enabled(True)
    views(x)
    assert len(view_calls) == 2


def test_dispatcher_replay_keeps_a_kernel_errors_type():
    op_may_fail, fail = _op_failing_on_demand()
    op, calls = _dispatched_op("may_fail", "(Tensor x) -> Tensor", op_may_fail)
    op(torch.randn(2, 2))
    fail["on"] = True
    with pytest.raises(IndexError, match="no such row"):
        op(torch.randn(2, 2))
    assert len(calls) == 1


def test_dispatcher_replays_only_calls_bound_for_the_memoized_backend():
    def scaled(x, alpha=1.0):  # alpha * x + x
        return _axpy_op(x, x, alpha)

    op, calls = _dispatched_op("scaled", "(Tensor x, float alpha=1.0) -> Tensor", scaled)
    _TEST_LIB.impl("scaled", lambda x, alpha=1.0: torch.empty_like(x), "Meta")
    x = torch.randn(2, 3)
    op(x, 3.0)
    op(x, 3.0)  # replayed from here on
    assert len(calls) == 1
    out = op(torch.empty(2, 3, device="meta"), 3.0)  # the Meta kernel, not a CPU replay
    assert out.device.type == "meta" and len(calls) == 1


def test_dispatcher_registration_of_a_name_again_replaces_the_first():
    def double(x):
        return _axpy_op(x, x, 1.0)

    op, calls = _dispatched_op("double", "(Tensor x) -> Tensor", double)
    x = torch.randn(3, 3)
    torch.testing.assert_close(op(x), 2 * x, rtol=0, atol=0)
    hits = launch_memo.stats()[1]

    def triple(x):
        return _axpy_op(x, x, 2.0)

    again = torch.library.Library("cute_moe_memo_test", "IMPL")
    memo = launch_memo.memoized(triple, "cute_moe_memo_test::double", "CPU")
    with pytest.warns(UserWarning, match="Overriding a previously registered kernel"):
        again.impl("double", memo, "CPU")
    for _ in range(3):  # records under the new id, then replays: never the first plan
        torch.testing.assert_close(op(x), 3 * x, rtol=0, atol=0)
    assert launch_memo.stats()[1] == hits + 2
    assert torch._C._dispatch_dump("cute_moe_memo_test::double").count("BackendSelect: registered") == 1
