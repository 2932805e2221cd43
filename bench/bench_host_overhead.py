"""Eager host overhead of every op at decode size: mean wall time per call of
``torch.ops.cute_moe.<op>`` on the host, with inputs so small that the GPU keeps up.

    python bench/bench_host_overhead.py [--calls N]

DeepSeek-V3 shapes at T=1 (H=7168, E=256, k=8, I=2048); the KV fill is a decode step of B=1.
grouped_gemm_fp8 and grouped_gemm_fp8_swiglu run on a small problem (K=512, N=256): at
DeepSeek-V3's w13 shape the GEMM's GPU time (~40 µs) exceeds the host time and the loop would time
the GPU; the host path does not depend on the sizes.  Two paths per op: ``torch.ops.cute_moe.<op>`` (through the dispatcher) and the
functional API's eager path (``cute_moe.<op>``: the op's CUDA implementation called directly).
Targets: <= 15 µs per op (issue 5), <= 10 µs for grouped_gemm_fp8 (issue 3).

Eager calls go through the launch memo (``cute_moe/launch_memo.py``): after the first call with
given argument metadata, a call is replayed in C++.  Each round times every op with the memo on
and off (``launch_memo.set_enabled``), back to back; the table gives each path's minimum over the
rounds (this host's timings drift by tens of percent between runs).  "Off" still passes each call
through the memo's dispatcher kernel and compiled-kernel wrapper, so it is somewhat slower than the
ops' Python path was before the memo (the memo's gain is overstated by that much).  ``fused_moe (small)`` is a
whole eager layer at T=1 (H=512, I=256, E=16, top-4): its seven steps through the memo.

Each row also gives the op's GPU time per call (back-to-back in a CUDA graph): a host time at or
below it would be the GPU's pace, not the host's, and is marked ``(GPU-bound)``.  For scale, the
same run times one ``torch.empty`` and one native eager op (``torch.add`` of two small tensors,
allocation and launch included) on the GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.timing import Timer, host_us_per_call  # noqa: E402

import cute_moe  # noqa: E402  (registers torch.ops.cute_moe)
from cute_moe import launch_memo  # noqa: E402
from cute_moe.reference import quant_block_128x128_ref  # noqa: E402

H, E, K, INTER = 7168, 256, 8, 2048


class _Direct:
    """``cute_moe.ops.call``: the path the functional API (``cute_moe.quant_fp8(...)``) takes eagerly."""

    def __getattr__(self, name):
        return lambda *args: cute_moe.ops.call(name, *args)


def cases(ops=None):
    """op name -> a decode-size call; ``ops``: ``torch.ops.cute_moe`` (default) or ``_Direct()``."""
    ops = torch.ops.cute_moe if ops is None else ops
    dev = "cuda"
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(1, E, device=dev)
    bias = torch.randn(E, device=dev)
    ids, w = ops.route(logits, K, "deepseek_v3", bias, 8, 4, 2.5)
    off, r2t, t2r, counts = ops.align(ids, E, 128, 0, None)
    a, _ = ops.permute_quant(x, r2t, off, None)
    h = torch.randn(a.shape[0], 2 * INTER, device=dev, dtype=torch.bfloat16)
    a2, a2_s = ops.silu_mul_quant(h, off, True, None)
    a_small, a_small_s = ops.permute_quant(x[:, :512].contiguous(), r2t, off, None)
    b_small = torch.randn(E, 256, 512, device=dev).to(torch.float8_e4m3fn)
    b_small_s = torch.rand(E, 2, 4, device=dev)
    w13_small, w13_small_s = quant_block_128x128_ref(torch.randn(E, 256, 512, device=dev) * 0.05)  # 2I = 256
    y = torch.randn(a2.shape[0], H, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(1, K, H, device=dev, dtype=torch.bfloat16)
    kc = torch.zeros(16, 64, 8, 128, device=dev, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ksc = torch.zeros(16, 64, 8, 1, device=dev)
    vsc = torch.zeros_like(ksc)
    k_new = torch.randn(1, 8, 128, device=dev, dtype=torch.bfloat16)
    v_new = torch.randn(1, 8, 128, device=dev, dtype=torch.bfloat16)
    w13, w13_s = quant_block_128x128_ref(torch.randn(16, 512, 512, device=dev) * 0.05)
    w2, w2_s = quant_block_128x128_ref(torch.randn(16, 512, 256, device=dev) * 0.05)
    small_layer = (torch.randn(1, 512, device=dev, dtype=torch.bfloat16), torch.randn(1, 16, device=dev),
                   w13, w13_s, w2, w2_s)  # fmt: skip
    cu = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    kv_len = torch.tensor([5], device=dev, dtype=torch.int32)
    blocks = torch.arange(4, device=dev, dtype=torch.int32).view(1, 4)
    return {
        "torch.empty": lambda: torch.empty(1, H, device=dev),
        "torch.add": lambda: torch.add(logits, logits),
        "quant_fp8": lambda: ops.quant_fp8(x, 128, None, False),
        "route": lambda: ops.route(logits, K, "deepseek_v3", bias, 8, 4, 2.5),
        "align": lambda: ops.align(ids, E, 128, 0, None),
        "permute_quant": lambda: ops.permute_quant(x, r2t, off, None),
        "grouped_gemm_fp8": lambda: ops.grouped_gemm_fp8(a_small, a_small_s, b_small, b_small_s, off, counts),
        "silu_mul_quant": lambda: ops.silu_mul_quant(h, off, True, None),
        # at T=1 one kernel: the 128-wide SwiGLU GEMM (the GEMM and silu_mul_quant's kernels before session 29)
        "grouped_gemm_fp8_swiglu": lambda: ops.grouped_gemm_fp8_swiglu(a_small, a_small_s, w13_small, w13_small_s, off,
                                                                       counts, True, None),  # fmt: skip
        "finalize": lambda: ops.finalize(y, w, t2r),
        "moe_reduce": lambda: ops.moe_reduce(hidden, w, False),
        "fill_kv_cache_fp8": lambda: ops.fill_kv_cache_fp8(k_new, v_new, kc, vc, ksc, vsc, cu, kv_len, blocks,
                                                           128, None, "bshd"),  # fmt: skip
        "fused_moe (small)": lambda: ops.fused_moe(*small_layer, 4, "softmax"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    via_ops, direct = cases(), cases(_Direct())
    timer = Timer()
    gpu = {name: 0.0 if name == "torch.empty" else timer.graph_amortized_us(fn) for name, fn in via_ops.items()}
    best: dict[tuple[str, bool, int], float] = {}
    for _ in range(args.rounds):
        for name in via_ops:
            for memo in (True, False):
                launch_memo.set_enabled(memo)
                for path, fn in enumerate((via_ops[name], direct[name])):
                    us = host_us_per_call(fn, args.calls)
                    best[name, memo, path] = min(us, best.get((name, memo, path), us))
    launch_memo.set_enabled(True)
    print(f"launch memo (entries, hits, misses): {launch_memo.stats()}; minimum of {args.rounds} rounds, µs per call")
    print(f"{'op':>18} {'torch.ops':>10} {'functional':>10} {'no memo: ops':>12} {'functional':>10} {'GPU us':>7}")
    for name in via_ops:
        on = [best[name, True, p] for p in (0, 1)]
        off = [best[name, False, p] for p in (0, 1)]
        flag = " (GPU-bound)" if min(on) <= 1.2 * gpu[name] else ""
        print(f"{name:>18} {on[0]:>10.1f} {on[1]:>10.1f} {off[0]:>12.1f} {off[1]:>10.1f} {gpu[name]:>7.1f}{flag}")


if __name__ == "__main__":
    main()
