"""fill_kv_cache_fp8 on the GPU: kernel time (CUDA graph, L2 flushed, median),
GB/s and share of the copy bandwidth measured in the same run, beside the
plain-PyTorch implementation (cute_moe.reference.fill_kv_cache_fp8_ref on CUDA):
a table, a JSON file and a PNG.

    python bench/bench_kv_cache.py [--json PATH] [--png PATH] [--sweep]

Bytes counted minimally: read the new K (and V) states once, write their codes
and f32 scales once.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import cute_moe  # noqa: E402
from cute_moe.kernels.fill_kv_cache_fp8 import fill_kv_cache_fp8_cuda  # noqa: E402
from cute_moe.reference import fill_kv_cache_fp8_ref  # noqa: E402
from tests.kv_cases import make_kv_case  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import add_output_args, png_path, pyplot, save_figure, write_json  # noqa: E402

CONFIGS = {  # name: heads, head_dim, with_v
    "llama (H_kv=8, D=128, K+V)": (8, 128, True),
    "mla (H_kv=1, D=512, K only)": (1, 512, False),
}
WORKLOADS = {  # name: q_lens, histories
    "decode B=64": ([1] * 64, [1000 + 7 * i for i in range(64)]),
    "prefill 4096": ([4096], [0]),
    "prefill 65536": ([8192] * 8, [0] * 8),
}

TIMINGS = {  # a row's µs field: its line's label and style (cute_moe solid, the plain-PyTorch peer dashed)
    "us": ("graph replay, L2 flushed", "-"),
    "eager_us": ("kernel (eager launch), L2 flushed", "-"),
    "amortized_us": ("amortized (100 calls in a graph, inputs in L2)", "-"),
    "torch_us": ("plain PyTorch (eager, events)", "--"),
}
PCT_TIMINGS = ("us", "eager_us", "torch_us")  # the amortized figure reads from L2: no share of the copy bandwidth


def plot(rows: list[dict], path: str, device: str) -> None:
    """Per config: % of copy (top) and µs (bottom) against the workload's tokens, a timing a line; the
    plain-PyTorch peer dashed, its % of copy on the same minimal byte count."""
    plt = pyplot()
    if plt is None:
        return
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(2, len(configs), figsize=(7 * len(configs), 9), squeeze=False)
    for col, config in enumerate(configs):
        pct, times = axes[0][col], axes[1][col]
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in mine]
        for i, (key, (label, style)) in enumerate(TIMINGS.items()):
            line = dict(color=f"C{i}", marker="o", linestyle=style, label=label)
            if key in PCT_TIMINGS:
                pct.plot(tokens, [r["pct_copy"] * r["us"] / r[key] for r in mine], **line)
            times.plot(tokens, [r[key] for r in mine], **line)
        pct.axhline(100, color="k", linestyle=":", linewidth=1)
        pct.set_ylabel("% of copy bandwidth (bytes counted minimally)")
        pct.set_title(config)
        times.set_ylabel("µs")
        times.set_yscale("log")
        for ax in (pct, times):
            ax.set_xscale("log", base=2)
            ax.set_xticks(tokens)
            ax.set_xticklabels([f"{r['workload']}\n{r['tokens']} tokens" for r in mine], fontsize=8)
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, f"fill_kv_cache_fp8 (block 64, 1x128 groups), {device}", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_output_args(parser, "bench_kv_cache.json")
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernel's tokens-per-warp knob")
    args = parser.parse_args()
    png = png_path(args)
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    rows = []
    for cname, (heads, dim, with_v) in CONFIGS.items():
        for wname, (q_lens, hist) in WORKLOADS.items():
            case = make_kv_case(q_lens, hist, heads, dim, with_v=with_v, block_size=64)
            n_tok = sum(q_lens)
            sides = 2 if with_v else 1
            nbytes = sides * n_tok * heads * (dim * 2 + dim + dim // 128 * 4)
            us = timer.graph_us(lambda: cute_moe.fill_kv_cache_fp8(*case.args()))
            # The kernel alone: an eager call enqueued behind the timer's busy-wait (no graph launch).
            eager_us = timer.kernel_us(lambda: cute_moe.fill_kv_cache_fp8(*case.args()))
            # The reference uses data-dependent shapes (host syncs): events, not a graph.
            plain_us = timer.kernel_us(lambda: fill_kv_cache_fp8_ref(*case.args()), reps=20)
            amortized = timer.graph_amortized_us(lambda: cute_moe.fill_kv_cache_fp8(*case.args()))
            rows.append({"config": cname, "workload": wname, "tokens": n_tok, "us": us, "gbs": nbytes / us / 1e3,
                         "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs, "torch_us": plain_us, "eager_us": eager_us,
                         "eager_pct_copy": 100 * nbytes / eager_us / 1e3 / copy_gbs,
                         "amortized_us": amortized})
    print(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    print("us: device time of one graph replay, L2 flushed; kernel: one eager launch between events (no graph "
          "launch), L2 flushed; amortized: 100 back-to-back calls in one graph, per call (inputs stay in L2 where "
          "they fit)")
    print(f"{'config':<28} {'workload':<14} {'us':>8} {'GB/s':>7} {'%copy':>6} {'kernel us':>9} {'%copy':>6} "
          f"{'amortized':>9} {'torch us':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['config']:<28} {r['workload']:<14} {r['us']:>8.2f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{r['eager_us']:>9.2f} {r['eager_pct_copy']:>6.1f} {r['amortized_us']:>9.2f} {r['torch_us']:>9.1f} "
              f"{r['torch_us'] / r['us']:>7.1f}")
    if args.sweep:
        print("\nsweep (kernel module called directly): tokens per warp b, warps per CTA w, small-batch variant s; "
              "decode: amortized us, prefill: kernel us (eager, events) / %copy")
        knobs = {"decode B=64": [(1, 4, small) for small in (True, False)],
                 "prefill 65536": [(b, w, False) for b in (1, 2, 4) for w in (4, 8)]}
        for cname, (heads, dim, with_v) in CONFIGS.items():
            for wname, settings in knobs.items():
                q_lens, hist = WORKLOADS[wname]
                case = make_kv_case(q_lens, hist, heads, dim, with_v=with_v, block_size=64)
                sides = 2 if with_v else 1
                nbytes = sides * sum(q_lens) * heads * (dim * 2 + dim + dim // 128 * 4)
                cells = []
                for b, w, small in settings:
                    def call(b=b, w=w, small=small):
                        fill_kv_cache_fp8_cuda(*case.args(), 128, None, "bshd", max_tokens_per_warp=b,
                                               small_batch=small, warps_per_cta=w)
                    us = timer.graph_amortized_us(call) if sum(q_lens) < 1024 else timer.kernel_us(call)
                    cells.append(f"b{b}w{w}{'s' if small else ''}: "
                                 f"{us:.2f}us/{100 * nbytes / us / 1e3 / copy_gbs:.1f}%")
                print(f"  {cname:<28} {wname:<14} " + "  ".join(cells))
    write_json(args.json, {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows})
    plot(rows, png, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
