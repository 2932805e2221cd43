"""Where an eager op call spends its host time: cProfile over many calls of
``cute_moe.quant_fp8`` on one token (the GPU is idle, so the host is the cost).

    python bench/profile_host_overhead.py [calls]
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch

import cute_moe


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        cute_moe.quant_fp8(x)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        cute_moe.quant_fp8(x)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    print(f"per call: {stats.total_tt / calls * 1e6:.1f} us of profiled host time (cProfile inflates it)")
    stats.print_stats(15)


if __name__ == "__main__":
    main()
