"""Clocks and power while a model's MoE layer runs back to back: is it power-capped?

    python bench/probe_power.py [--only DeepSeek-V3] [--tokens 128,4096,8192] [--seconds 6]

For each T, ``bench_moe``'s cute_moe layer (same seeded weights, inputs and routing) is captured in a
CUDA graph and replayed with no pause for ``--seconds`` while ``nvidia-smi`` samples the SM clock,
memory clock and board power every 100 ms.  Printed per T: µs per layer back to back, the SM clock
(median, min-max), the power (median, max) against the board's limit, and the energy per layer
(median power x µs).  At the power limit, time is energy / limit: whatever a kernel wastes (math on
padding rows, DRAM re-reads) costs clock even where it costs no cycles.  ``bench_moe``'s µs come
from replays with an L2 flush between them, so they run somewhat cooler than these.

Session 26 (H200, DeepSeek-V3, first form of this probe): T = 4096 and 8192 at 693-695 W against
700 W, SM clock 1425 MHz median against 1980 max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
from bench_io import parse_tokens  # noqa: E402

_QUERY = "clocks.sm,clocks.mem,power.draw"
_SKIP_S = 1.0  # samples of the first second are dropped: the clock is still settling


def parse_samples(lines: list[str]) -> list[tuple[float, float, float]]:
    """(SM MHz, memory MHz, W) per ``nvidia-smi --format=csv,noheader,nounits`` line of ``_QUERY``;
    lines that are not three numbers (a sample the driver could not take: "[N/A]") are dropped."""
    out = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        try:
            sm, mem, watts = (float(c) for c in cells)
        except ValueError:
            continue
        out.append((sm, mem, watts))
    return out


def _smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], check=True, capture_output=True, text=True).stdout.strip()


def measure(graph: torch.cuda.CUDAGraph, seconds: float) -> tuple[float, list[tuple[float, float, float]]]:
    """(µs per replay, samples) over ``seconds`` of back-to-back replays."""
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        time.sleep(0.2)
        start, begin, end = time.time(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 0
        begin.record()
        while time.time() - start < seconds:
            for _ in range(20):
                graph.replay()
            replays += 20
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    finally:
        sampler.terminate()
    samples = parse_samples(sampler.communicate()[0].splitlines())
    skip = int(_SKIP_S / 0.1)
    return begin.elapsed_time(end) * 1000 / replays, samples[skip:-1] or samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="DeepSeek-V3", help="the bench_moe model whose name is exactly this")
    parser.add_argument("--tokens", default="128,4096,8192")
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    models = [m for m in bench_moe.MODELS if m.name == args.only]
    if not models:
        raise SystemExit(f"--only {args.only!r}: not one of {', '.join(m.name for m in bench_moe.MODELS)}")
    if not torch.cuda.is_available():
        raise SystemExit("probe_power needs a CUDA GPU and nvidia-smi")
    import cute_moe  # noqa: PLC0415

    m = models[0]
    bench_moe.seed_from(m.name)
    layer = bench_moe.cute_moe_layer(cute_moe.FusedMoE, m, bench_moe.make_weights(m, False, False))
    limit, max_sm = _smi("--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader").split(", ")
    print(f"{torch.cuda.get_device_name()}: power limit {limit}, max SM clock {max_sm}; {m.name}")
    print(f"{'T':>6} {'µs/layer':>9} {'SM MHz: median (min-max)':>26} {'mem MHz':>8} {'W: median (max)':>16} {'mJ/layer':>9}")
    for T in parse_tokens(args.tokens, bench_moe.TOKENS):
        x, logits = bench_moe.layer_inputs(m, T)
        layer(x, logits)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, logits)
        us, samples = measure(graph, args.seconds)
        sm, mem, watts = zip(*samples)
        clock = f"{statistics.median(sm):.0f} ({min(sm):.0f}-{max(sm):.0f})"
        power = f"{statistics.median(watts):.0f} ({max(watts):.0f})"
        print(f"{T:>6} {us:9.1f} {clock:>26} {statistics.median(mem):8.0f} {power:>16} "
              f"{statistics.median(watts) * us / 1000:9.1f}")  # µJ / 1000


if __name__ == "__main__":
    main()
