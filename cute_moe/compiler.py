"""Compile scaffolding shared by every CuTe DSL kernel of cute_moe.

* Target selection: a CUDA tensor's device capability picks the architecture
  (9.0 -> sm_90a, 10.0 -> sm_100a); with no GPU (inspection, CI) the caller names
  it and ``CUTE_DSL_ARCH`` is set before ``cutlass.cute`` is first imported,
  because the DSL reads it once and otherwise defaults silently to sm_100a.
* Kernels are compiled from fake tensors (``cute.runtime.make_fake_tensor``) with
  dynamic extents and strides, so one binary serves every problem size and the
  compile key holds scalars only (dtypes, group sizes, flags, arch).
* ``--enable-tvm-ffi``: the compiled function takes torch tensors directly and
  launches on the current torch stream (the TVM-FFI environment stream), which
  keeps host overhead at a few microseconds and makes CUDA-graph capture work.
* An in-memory cache keyed on every static parameter; ``cute.compile`` is not
  thread-safe, so compilation holds a lock.  Compiling while a CUDA graph is
  being captured is refused: run the op once eagerly (same static parameters)
  before capture.  There is no disk cache yet: a new process compiles each
  variant it uses once (about a second each).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import tempfile
import threading
from typing import Any, Callable, Optional

import torch

from cute_moe import launch_memo

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")
_CAPABILITY_TO_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a"}

_compile_lock = threading.RLock()


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"cute_moe: arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    return arch


def arch_of_device(device: torch.device) -> str:
    """The kernel target for a CUDA device, or NotImplementedError for others."""
    return arch_of_device_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def arch_of_device_index(device: int) -> str:
    cap = torch.cuda.get_device_capability(device)
    arch = _CAPABILITY_TO_ARCH.get(tuple(cap))
    if arch is None:
        raise NotImplementedError(
            f"cute_moe: no kernels for compute capability {cap[0]}.{cap[1]} "
            f"({torch.cuda.get_device_name(device)}); supported: 9.0 (sm_90a, Hopper), "
            "10.0 (sm_100a, Blackwell)"
        )
    return arch


def import_cute(arch: str | None = None):
    """Import ``cutlass.cute`` lazily; with ``arch`` and no GPU, pin the DSL's default target.

    The DSL reads ``CUTE_DSL_ARCH`` once, at import; every compile also passes
    ``--gpu-arch`` explicitly, so the binary's target never depends on that default.
    """
    if arch is not None:
        check_arch(arch)
        if "cutlass.cute" not in sys.modules and not os.environ.get("CUTE_DSL_ARCH"):
            os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass.cute as cute  # noqa: PLC0415 (lazy by design: importing cute_moe must stay cheap)

    return cute


def fake_tensor(dtype, shape, stride, align: int = 16):
    """A global-memory fake tensor for compilation.  Never a CPU tensor: ``from_dlpack`` of one
    gives a generic address space, and kernels that ``cute.copy`` from global memory (the cp.async
    scale loads) then fail IR verification; fake tensors also keep a compile independent of any
    particular tensor."""
    if align > 16:  # the launch memo keys addresses by their alignment up to 16 B only
        raise ValueError(f"cute_moe: fake_tensor's align must be at most 16 bytes, got {align}")
    cute = import_cute()
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_stream():
    cute = import_cute()
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_kernel(kernel: Any, *fake_args, arch: str, keep_cubin: bool = False):
    """``cute.compile`` a kernel object for ``arch`` with the TVM-FFI calling convention."""
    cute = import_cute(arch)
    options = f"--enable-tvm-ffi --gpu-arch {check_arch(arch)}"
    recorder = launch_memo.recording()
    if recorder is not None:
        recorder.compiled = True
    with _compile_lock, tempfile.TemporaryDirectory(prefix="cute_moe_") as dump_dir:
        if keep_cubin:  # the cubin bytes land in .artifacts.CUBIN; the dumped file is dropped
            options += f" --keep-cubin --dump-dir={dump_dir}"
        fn = cute.compile(kernel, *fake_args, fake_stream(), options=options)
    # Every parameter given positionally, none keyword-only, no dataclass: the DSL's Python
    # wrapper then passes a call's arguments through unchanged, as a replay does.
    keyword_only = any(p.kind is p.KEYWORD_ONLY for p in inspect.signature(type(kernel).__call__).parameters.values())
    plain = not keyword_only and not any(dataclasses.is_dataclass(a) for a in fake_args)
    return CompiledKernel(fn, len(fake_args) if plain else None)


class CompiledKernel:
    """A compiled function, called as before; a call the launch memo is recording is noted
    (``launch_memo.py``).  Attributes are the compiled function's.  ``arity``: the number of
    positional arguments a call passes through the DSL's wrapper unchanged (None: the wrapper
    may rewrite them, so calls are not replayable)."""

    __slots__ = ("fn", "arity")

    def __init__(self, fn: Any, arity: Optional[int]):
        self.fn = fn
        self.arity = arity

    def __call__(self, *args: Any) -> Any:
        recorder = launch_memo.recording()
        if recorder is None:
            return self.fn(*args)
        recorder.calls.append((self, args))
        out = self.fn(*args)
        if out is not None:  # a replay could not reproduce what the host does with it
            recorder.memoizable = False
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def handle(self, num_args: int) -> Optional[int]:
        """The TVM-FFI function's C handle (``TVMFFIObjectHandle``) for a call with ``num_args``
        positional arguments, or None when such a call cannot be replayed by that handle."""
        if self.arity is None or num_args != self.arity:
            return None
        if getattr(getattr(self.fn, "execution_args", None), "has_pointer_address_arg_specs", False):
            return None  # the wrapper converts pointer arguments
        ffi = self.fn.__tvm_ffi_object__() if hasattr(self.fn, "__tvm_ffi_object__") else self.fn
        handle = getattr(ffi, "__chandle__", None)
        return handle() if handle is not None else None


def cached_compile(fn: Callable) -> Callable:
    """Memoise a compile function whose arguments are all hashable scalars.

    Refuses to compile during CUDA-graph capture: the first call of a compiled
    function loads its module, which must not happen inside a capture.
    """
    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(*key):
        hit = cache.get(key)
        if hit is not None:
            return hit
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"cute_moe: {fn.__name__}{key} is not compiled yet and a CUDA graph is being "
                "captured; run the op once eagerly with the same dtypes and options before capture"
            )
        with _compile_lock:
            if key not in cache:
                cache[key] = fn(*key)
        return cache[key]

    wrapper.cache = cache
    return wrapper


def torch_to_cutlass_dtype(dtype: torch.dtype):
    import cutlass  # noqa: PLC0415

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.uint8: cutlass.Uint8,
        torch.int32: cutlass.Int32,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
    }
    return table[dtype]
