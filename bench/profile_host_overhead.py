"""Where an eager op call spends its host time: cProfile over many decode-size calls of one op
(the GPU is idle, so the host is the cost).

    python bench/profile_host_overhead.py [OP] [calls]      # OP: a key of bench_host_overhead.cases()
    python bench/profile_host_overhead.py --breakdown       # quant_fp8's pieces, un-profiled
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host_overhead import cases  # noqa: E402


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "quant_fp8"
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    fn = cases()[op]
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    print(f"{op}: {stats.total_tt / calls * 1e6:.1f} us per call of profiled host time (cProfile inflates it)")
    stats.print_stats(14)


def breakdown() -> None:
    """Un-profiled wall times of the pieces of one eager quant_fp8 call (T=1, H=7168)."""
    from cute_moe.timing import host_us_per_call  # noqa: PLC0415

    from cute_moe import validation as V  # noqa: PLC0415
    from cute_moe.compiler import arch_of_device  # noqa: PLC0415
    from cute_moe.kernels.quant_fp8 import compile_quant_fp8, quant_fp8_cuda  # noqa: PLC0415

    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(1, 7168, device="cuda", dtype=torch.uint8)
    s = torch.empty(1, 56, device="cuda")
    fn = compile_quant_fp8(x.dtype, 128, False, arch_of_device(x.device))
    pieces = {
        "torch.ops.cute_moe.quant_fp8": lambda: torch.ops.cute_moe.quant_fp8(x, 128, None, False),
        "quant_fp8_cuda (launcher)": lambda: quant_fp8_cuda(x, 128, None, False),
        "validate_quant_fp8": lambda: V.validate_quant_fp8(x, 128, None, False),
        "compiled call, outputs given": lambda: fn(x, q, s),
        "torch.empty x 2": lambda: (torch.empty(1, 7168, device="cuda"), torch.empty(1, 56, device="cuda")),
        "arch_of_device": lambda: arch_of_device(x.device),
        "compile cache hit": lambda: compile_quant_fp8(x.dtype, 128, False, "sm_90a"),
    }
    for name, f in pieces.items():
        print(f"{name:>32} {host_us_per_call(f):8.2f} us")


if __name__ == "__main__":
    breakdown() if "--breakdown" in sys.argv else main()
