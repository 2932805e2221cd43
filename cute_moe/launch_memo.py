"""The launch memo: eager CUDA calls of an op replayed in C++ once their argument metadata was seen.

An op's CUDA implementation is a pure function of its arguments' *metadata* -- each tensor's
dtype, device, sizes, strides and address alignment, and the scalar arguments -- as far as the
host is concerned: validation reads nothing else, and neither do the choices of kernel, grid and
output layout.  So the first call with given metadata runs the Python implementation under a
recorder that notes

* every aten op it runs: only allocations (``empty``, ``empty_strided``, ...) and views are
  allowed; anything else (a copy, a fill, a read of the data) makes the call not memoizable;
* every compiled kernel it calls (``compiler.CompiledKernel``): the TVM-FFI function and each
  argument, a tensor as a view of one input or one allocation (byte offset, DLPack shape, strides
  and dtype), a scalar as its value;
* what it returns: allocations, or views of them.

Later calls with equal metadata skip Python: ``lookup`` (C++) builds the key, allocates the
outputs with the recorded sizes and strides, calls the kernels through ``TVMFFIFunctionCall``
on torch's current stream of the tensors' device, and returns the outputs.  Calls through
``torch.ops`` do not even reach Python: a C++ kernel on the op's BackendSelect dispatch key (the
last key before the device's own kernel) builds the same key from the dispatcher's arguments and
replays, or passes the call on to the Python implementation.  A call whose
validation fails raises before anything is recorded, so bad input always takes the Python path
and its message.  Inputs that share storage (k and v sliced from one qkv tensor) are keyed by which
earlier input they share it with and at what byte distance, and a kernel argument on that storage
is recorded as an offset from the first of them, so a replay sees the aliasing the recorded call
saw.  Metadata whose call could not be recorded (host code beyond allocations and views) is
remembered too, and its later calls run the Python path without the recorder's cost.  A call
that compiled a kernel records nothing: replays begin with the third call of given metadata.  Arguments other than plain tensors,
``nn.Parameter``, bool / int / float / str / None, and every call while ``CUTE_MOE_DEBUG=1``
(its checks read data), take the Python path.  ``CUTE_MOE_LAUNCH_MEMO=0`` turns the memo off.
The memo holds at most 4096 entries (it is emptied when full).

The C side (``launch_memo.cpp``) is compiled with the system C++ compiler against the installed
torch, Python and tvm_ffi on first use (12-24 s measured, cached under ``~/.cache/cute_moe``); where
that fails the ops keep the Python path and a warning says why.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import itertools
import os
import subprocess
import sys
import sysconfig
import threading
import warnings
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MISS", "SKIP", "active", "clear", "load_extension", "memoized", "recording", "set_enabled", "stats"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_memo.cpp")


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"launch_memo.{self.name}"


MISS = _Sentinel("MISS")  # lookup: metadata not seen yet, record the call
SKIP = _Sentinel("SKIP")  # lookup: calls with this metadata cannot be replayed, run the Python path
class _ThreadState(threading.local):
    recorder: Optional[_Recorder] = None  # the _Recorder of a call being recorded on this thread


_tls = _ThreadState()
_op_ids = itertools.count()  # plans are keyed by these: one per memoized implementation
_ext: Any = None  # the loaded extension; False where it cannot be built or the memo is off
_loaded: Any = None  # the loaded extension, also while the memo is switched off
_ext_lock = threading.Lock()
_dispatched: dict[str, tuple[int, str]] = {}  # qualname -> (op id, dispatch key): replayed from the dispatcher too
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.empty_like.default,
    }
)


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "cute_moe")


def _build(path: str) -> None:
    import tvm_ffi.libinfo  # noqa: PLC0415 (only needed to build)
    from torch.utils import cpp_extension  # noqa: PLC0415

    tvm_lib = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()]  # fmt: skip
    out = path + f".{os.getpid()}.tmp"
    cmd = [
        os.environ.get("CXX", "c++"), "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{d}" for d in includes), _SOURCE, "-o", out,
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-L{tvm_lib}", "-ltvm_ffi",
        f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{tvm_lib}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    os.replace(out, path)


@functools.cache
def load_extension() -> Any:
    """The compiled C side, built on first use; raises if it cannot be built."""
    import tvm_ffi  # noqa: F401, PLC0415 (loads libtvm_ffi before the extension needs it)

    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(f"{torch.__version__} {sys.version} {tvm_ffi.__version__}".encode())
    path = os.path.join(_cache_dir(), f"_launch_memo-{digest.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _build(path)
    loader = importlib.machinery.ExtensionFileLoader("cute_moe._launch_memo", path)
    spec = importlib.util.spec_from_file_location("cute_moe._launch_memo", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.init(MISS, SKIP, torch.Tensor, torch.nn.Parameter)
    return module


def _extension() -> Any:
    global _ext, _loaded
    if _ext is None:
        with _ext_lock:
            if _ext is None:
                if os.environ.get("CUTE_MOE_LAUNCH_MEMO", "1") == "0":
                    _ext = False
                else:
                    try:
                        ext = load_extension()
                    except Exception as e:  # noqa: BLE001 (any build failure keeps the Python path)
                        warnings.warn(f"cute_moe: the launch memo is off (eager calls stay in Python): {e}",
                                      stacklevel=3)  # fmt: skip
                        _ext = False
                    else:
                        for qualname, (op_id, key) in _dispatched.items():
                            _register_dispatch(ext, qualname, op_id, key)
                        _ext = _loaded = ext
    return _ext


def _register_dispatch(ext: Any, qualname: str, op_id: int, dispatch_key: str) -> None:
    try:
        ext.register_dispatch(qualname, op_id, dispatch_key)
    except Exception as e:  # noqa: BLE001 (that op's torch.ops calls keep the Python lookup)
        warnings.warn(f"cute_moe: torch.ops calls of {qualname} are replayed through Python: {e}", stacklevel=4)


class _Recorder(TorchDispatchMode):
    """Notes the allocations, the compiled-kernel calls and anything else a call runs."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[torch.Tensor] = []
        self.calls: list[tuple[Any, tuple]] = []
        self.memoizable = True
        self.compiled = False  # a kernel was compiled during the call (compiler.compile_kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        elif not func.is_view:
            self.memoizable = False
        elif func is torch.ops.aten.as_strided.default:
            # its storage_offset counts from the storage's start, which the key does not hold:
            # only views that keep the input's own offset are replayable
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
            if offset is not None and offset != args[0].storage_offset():
                self.memoizable = False
        return out

    def plan(self, args: tuple, out: Any) -> Optional[tuple]:
        """``store``'s arguments after ``args``, or None when the call cannot be replayed."""
        if not self.memoizable:
            return None
        # storage -> (0 input | 1 allocation, index): of inputs sharing storage the first, as the
        # key records the others' distance to it
        sources: dict[int, tuple[int, int]] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                sources.setdefault(a.untyped_storage()._cdata, (0, i))
        for j, t in enumerate(self.allocations):
            sources[t.untyped_storage()._cdata] = (1, j)
        calls = []
        for kernel, kargs in self.calls:
            encoded = []
            for a in kargs:
                if isinstance(a, torch.Tensor):
                    source = sources.get(a.untyped_storage()._cdata)
                    if source is None:
                        return None
                    encoded.append((*source, a))
                elif a is None or type(a) in (bool, int, float):
                    encoded.append(a)
                else:
                    return None
            handle = kernel.handle(len(kargs))
            if handle is None:
                return None
            calls.append((handle, encoded))
        if out is None:
            kind, outs = 0, []
        elif isinstance(out, torch.Tensor):
            kind, outs = 1, [out]
        elif isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
            kind, outs = 2, list(out)
        else:
            return None
        results = []
        for t in outs:
            source = sources.get(t.untyped_storage()._cdata)
            if source is None or source[0] != 1 or t.dtype != self.allocations[source[1]].dtype:
                return None
            results.append((source[1], t))
        return self.allocations, calls, kind, results


def recording() -> Optional[_Recorder]:
    """The recorder of the call running on this thread, if one is being recorded."""
    return _tls.recorder


def _record(ext: Any, op_id: int, impl: Callable[..., Any], args: tuple) -> Any:
    recorder = _Recorder()
    _tls.recorder = recorder
    try:
        with recorder:
            out = impl(*args)
    finally:
        _tls.recorder = None
    if recorder.compiled:
        return out  # what compiling runs says nothing about the next call: that one records
    try:
        plan = recorder.plan(args, out)
        if plan is not None:
            ext.store(op_id, args, *plan)
        else:
            ext.store(op_id, args)
    except Exception:  # noqa: BLE001 (the call itself succeeded: its result stands, unmemoized)
        ext.store(op_id, args)
    return out


def memoized(impl: Callable[..., Any], qualname: Optional[str] = None,
             dispatch_key: str = "CUDA") -> Callable[..., Any]:  # fmt: skip
    """``impl`` (an op's CUDA implementation) behind the memo, under an op id of its own (plans are
    keyed by it).  With ``qualname`` (``"ns::name"``, the op defined already),
    calls through the dispatcher (``torch.ops.ns.name``) bound for ``dispatch_key`` are replayed
    too, by a kernel the extension registers on the op's BackendSelect key once it is loaded; the
    function returned must then be the op's kernel for that key.  That registration lasts as long
    as the process (a later ``memoized`` of the same name replaces it)."""
    op_id = next(_op_ids)
    if qualname is not None:
        with _ext_lock:
            _dispatched[qualname] = (op_id, dispatch_key)
            if _loaded:
                _register_dispatch(_loaded, qualname, op_id, dispatch_key)

    def run(*args: Any) -> Any:
        ext = _ext if _ext is not None else _extension()
        if ext is False or recording() is not None:
            return impl(*args)
        out = ext.lookup(op_id, args)
        if out is MISS:
            return _record(ext, op_id, impl, args)
        if out is SKIP:
            return impl(*args)
        return out

    run.__wrapped__ = impl
    run.__name__ = getattr(impl, "__name__", "run")
    return run


def active() -> bool:
    """Whether eager calls are memoized in this process (builds or loads the extension on first use)."""
    return bool(_ext if _ext is not None else _extension())


def set_enabled(on: bool) -> None:
    """Turn the memo on or off in this process (benchmarks compare the two paths)."""
    global _ext
    with _ext_lock:
        _ext = (_loaded or None) if on else False
        if _loaded:
            _loaded.set_enabled(on)


def stats() -> tuple[int, int, int]:
    """(entries held, replayable or not; hits; misses) since the last ``clear``; zeros while the
    memo is off or not loaded yet."""
    return _loaded.stats() if _loaded else (0, 0, 0)


def clear() -> None:
    if _loaded:
        _loaded.clear()
