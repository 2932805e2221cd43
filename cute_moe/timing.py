"""GPU timing for ``python -m cute_moe`` and the benchmarks in ``bench/``: CUDA events, L2 flushed,
median of many runs.  Needs CUDA; never imported on the CPU path."""
from __future__ import annotations

import statistics
import time

import torch

_L2_FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
_HOST_ENQUEUE_CYCLES = 200_000  # ~100 µs of GPU busy-wait: more than any eager call's host time


def run_without_host_sync(fn) -> None:
    """fn() once, RuntimeError if it synchronizes with the host (``.item()``, ``bool(tensor)``, a
    blocking copy to the CPU), before anything tries to capture it: a capture that such a call
    invalidates can leave torch's caching allocator believing a capture is still under way (torch
    2.11), and every later ``empty_cache`` or capture in the process then fails."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class Timer:
    def __init__(self):
        self._flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def kernel_us(self, fn, reps: int = 100, warmup: int = 5) -> float:
        """Median device time of fn() in µs, each run after an L2 flush.

        A busy-wait kernel runs between the flush and the start event, long enough for the
        host to enqueue fn() behind it: the interval then holds fn's device work alone, not
        the host's launch latency (which for a graph replay is a few µs).
        """
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            # Flush by reading: a write flush (zero_) leaves 60 MB of dirty lines whose
            # write-back would then be charged to fn.
            self._flush_sum = self._flush.sum()
            torch.cuda._sleep(_HOST_ENQUEUE_CYCLES)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    def graph_us(self, fn, reps: int = 100) -> float:
        """Median device time of fn() captured in a CUDA graph (no gaps between its kernels), L2 flushed.
        RuntimeError, before any capture, if fn synchronizes with the host (``run_without_host_sync``)."""
        run_without_host_sync(fn)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.kernel_us(graph.replay, reps)

    def time_us(self, fn, reps: int = 100) -> tuple[float, str]:
        """(µs, "graph") when fn can be captured in a CUDA graph, else (µs of eager runs, "eager"): a
        function that synchronizes with the host is timed eagerly without a capture being tried
        (``graph_us`` refuses it first)."""
        try:
            return self.graph_us(fn, reps), "graph"
        except Exception:  # noqa: BLE001 (a host sync inside fn, or capture refused for another reason)
            torch.cuda.synchronize()
            return self.kernel_us(fn, reps), "eager"

    def graph_amortized_us(self, fn, calls: int = 100, reps: int = 20) -> float:
        """Per-call device time of ``calls`` back-to-back fn() in one CUDA graph (no flush between).

        For microsecond kernels, where one graph launch's own overhead (a few µs) would
        dominate ``graph_us``; inputs that fit in L2 stay there, as in a decode step.
        """
        run_without_host_sync(fn)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize()
        return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / calls

    def copy_bandwidth_gbs(self, nbytes: int = 2 << 30) -> float:
        """Device-to-device copy bandwidth, bytes read + written."""
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        us = self.kernel_us(lambda: dst.copy_(src), reps=30)
        return 2 * nbytes / us / 1e3

    def write_bandwidth_gbs(self, nbytes: int = 1 << 30) -> float:
        """Write-only bandwidth (a fill kernel): the ceiling of a write-mostly stream, which on an
        H200 is well below the copy figure."""
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        us = self.kernel_us(lambda: dst.fill_(7), reps=30)
        return nbytes / us / 1e3


def host_us_per_call(fn, calls: int = 2000) -> float:
    """Mean wall time of an eager call on the host (the GPU queue keeps up for small problems)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6
