"""Eager host overhead of every op at decode size: mean wall time per call of
``torch.ops.cute_moe.<op>`` on the host, with inputs so small that the GPU keeps up.

    python bench/bench_host_overhead.py [--calls N] [--rounds N] [--json PATH]

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
whole eager layer at T=1 (H=512, I=256, E=16, top-4): its seven steps through the memo;
``fused_moe_routed (small)`` the same layer from top-k ids and weights (route's, computed once):
its six steps from align on.

Each row also gives the op's GPU time per call (back-to-back in a CUDA graph): a host time at or
below it would be the GPU's pace, not the host's, and is marked ``(GPU-bound)``.  For scale, the
same run times one ``torch.empty`` and one native eager op (``torch.add`` of two small tensors,
allocation and launch included) on the GPU.  The JSON file holds the table's rows.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.timing import Timer, host_us_per_call  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

import cute_moe  # noqa: E402  (registers torch.ops.cute_moe)
from cute_moe import launch_memo  # noqa: E402
from cute_moe.reference import quant_block_128x128_ref  # noqa: E402

H, E, K, INTER = 7168, 256, 8, 2048


class _Direct:
    """``cute_moe.ops.call``: the path the functional API (``cute_moe.quant_fp8(...)``) takes eagerly."""

    def __getattr__(self, name):
        return lambda *args: cute_moe.ops.call(name, *args)


def cases(ops=None, dev: str = "cuda"):
    """op name -> a decode-size call; ``ops``: ``torch.ops.cute_moe`` (default) or ``_Direct()``; ``dev``:
    the tensors' device (the CPU tests call each case once on "cpu", where the ops run their references)."""
    ops = torch.ops.cute_moe if ops is None else ops
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(1, E, device=dev)
    bias = torch.randn(E, device=dev)
    ids, w = ops.route(logits, K, "deepseek_v3", bias, 8, 4, 2.5)
    off, r2t, t2r, counts = ops.align(ids, E, 128, 0, None)
    a, _ = ops.permute_quant(x, r2t, off, None)
    x_fp8, x_fp8_s = ops.quant_fp8(x, 128, None, False)
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
    x_small, logits_small = torch.randn(1, 512, device=dev, dtype=torch.bfloat16), torch.randn(1, 16, device=dev)
    ids_small, w_small = ops.route(logits_small, 4, "softmax", None, 1, 1, 1.0)
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
        "permute": lambda: ops.permute(x_fp8, x_fp8_s, r2t, off),
        "grouped_gemm_fp8": lambda: ops.grouped_gemm_fp8(a_small, a_small_s, b_small, b_small_s, off, counts),
        "silu_mul_quant": lambda: ops.silu_mul_quant(h, off, True, None),
        # at T=1 one kernel: the 128-wide SwiGLU GEMM (the GEMM and silu_mul_quant's kernels before session 29)
        "grouped_gemm_fp8_swiglu": lambda: ops.grouped_gemm_fp8_swiglu(a_small, a_small_s, w13_small, w13_small_s, off,
                                                                       counts, True, None),  # fmt: skip
        "finalize": lambda: ops.finalize(y, w, t2r),
        "moe_reduce": lambda: ops.moe_reduce(hidden, w, False),
        "fill_kv_cache_fp8": lambda: ops.fill_kv_cache_fp8(k_new, v_new, kc, vc, ksc, vsc, cu, kv_len, blocks,
                                                           128, None, "bshd"),  # fmt: skip
        "fused_moe (small)": lambda: ops.fused_moe(x_small, logits_small, w13, w13_s, w2, w2_s, 4, "softmax"),
        "fused_moe_routed (small)": lambda: ops.fused_moe_routed(x_small, ids_small, w_small, w13, w13_s, w2, w2_s),
    }


def table_rows(best: dict, gpu: dict) -> list[dict]:
    """One row per op from ``best[op, memo on, path]`` (path 0: torch.ops, 1: functional; the minimum µs
    over the rounds) and ``gpu[op]`` (µs per call back to back in a graph)."""
    rows = []
    for name, gpu_us in gpu.items():
        on = [best[name, True, p] for p in (0, 1)]
        off = [best[name, False, p] for p in (0, 1)]
        rows.append({"op": name, "torch_ops_us": on[0], "functional_us": on[1], "no_memo_torch_ops_us": off[0],
                     "no_memo_functional_us": off[1], "gpu_us": gpu_us, "gpu_bound": min(on) <= 1.2 * gpu_us})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'op':>24} {'torch.ops':>10} {'functional':>10} {'no memo: ops':>12} {'functional':>10} {'GPU us':>7}")
    for r in rows:
        flag = " (GPU-bound)" if r["gpu_bound"] else ""
        print(f"{r['op']:>24} {r['torch_ops_us']:>10.1f} {r['functional_us']:>10.1f} "
              f"{r['no_memo_torch_ops_us']:>12.1f} {r['no_memo_functional_us']:>10.1f} {r['gpu_us']:>7.1f}{flag}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=default_json("bench_host_overhead.json"))
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
    memo_stats = launch_memo.stats()
    rows = table_rows(best, gpu)
    print(f"launch memo (entries, hits, misses): {memo_stats}; minimum of {args.rounds} rounds, µs per call")
    print_table(rows)
    write_json(args.json, {"device": torch.cuda.get_device_name(), "calls": args.calls, "rounds": args.rounds,
                           "launch_memo_stats": memo_stats, "rows": rows})  # fmt: skip
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
