"""quant_fp8 on the GPU: kernel time, bandwidth, share of the measured copy bandwidth,
the plain-PyTorch composition (cute_moe.reference.quant_fp8_ref on CUDA tensors) in
the same run, and the eager host overhead per call: a table, a JSON file and a PNG.

    python bench/bench_quant_fp8.py [--json PATH] [--png PATH]

Bytes counted minimally: read x once, write the codes and the f32 scales once.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402
from cute_moe.compiler import arch_of_device  # noqa: E402
from cute_moe.kernels.quant_fp8 import compile_quant_fp8, quant_fp8_cuda  # noqa: E402
from cute_moe.reference import quant_fp8_ref  # noqa: E402
from cute_moe.timing import Timer, host_us_per_call  # noqa: E402
from bench_io import add_output_args, png_path, pyplot, save_figure, write_json  # noqa: E402

H = 7168
TOKENS = (1, 128, 4096, 16384)


def plot(rows: list[dict], path: str, device: str) -> None:
    """% of copy (left) and µs (right) against T: a scale format a colour, cute_moe solid, the plain-PyTorch
    composition dashed (its % of copy on the same minimal byte count)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (pct, times) = plt.subplots(1, 2, figsize=(13, 5))
    for i, fmt in enumerate(dict.fromkeys(r["scale_fmt"] for r in rows)):
        mine = sorted((r for r in rows if r["scale_fmt"] == fmt), key=lambda r: r["T"])
        t = [r["T"] for r in mine]
        for key, name, style in (("us", "cute_moe", "-"), ("torch_us", "plain PyTorch", "--")):
            line = dict(color=f"C{i}", marker="o^"[i % 2], linestyle=style, label=f"{name}, scales {fmt}")
            pct.plot(t, [r["pct_copy"] * r["us"] / r[key] for r in mine], **line)
            times.plot(t, [r[key] for r in mine], **line)
    pct.axhline(100, color="k", linestyle=":", linewidth=1)
    pct.set_ylabel("% of copy bandwidth (bytes counted minimally)")
    times.set_ylabel("µs (one graph replay, L2 flushed)")
    times.set_yscale("log")
    for ax in (pct, times):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"tokens T (H={H})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, f"quant_fp8 (1x128 groups), {device}", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_output_args(parser, "bench_quant_fp8.json")
    args = parser.parse_args()
    png = png_path(args)
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    rows = []
    for scale_fmt in (None, "ue8m0"):
        for t in TOKENS:
            x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
            nbytes = x.numel() * 2 + x.numel() + x.numel() // 128 * 4

            def ours():
                return cute_moe.quant_fp8(x, scale_fmt=scale_fmt)

            def plain():
                return quant_fp8_ref(x, 128, scale_fmt)

            us = timer.graph_us(ours)
            plain_us = timer.graph_us(plain)
            rows.append({
                "T": t, "H": H, "scale_fmt": scale_fmt or "none", "us": us,
                "gbs": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs,
                "torch_us": plain_us,
            })
    print(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    print(f"{'T':>6} {'H':>5} {'fmt':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} {'torch us':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['T']:>6} {r['H']:>5} {r['scale_fmt']:>6} {r['us']:>8.2f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{r['torch_us']:>9.2f} {r['torch_us'] / r['us']:>7.1f}")
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    q, s = cute_moe.quant_fp8(x)
    compiled = compile_quant_fp8(torch.bfloat16, 128, False, arch_of_device(x.device))
    host = {
        "op (cute_moe.quant_fp8)": host_us_per_call(lambda: cute_moe.quant_fp8(x)),
        "kernel module (quant_fp8_cuda)": host_us_per_call(lambda: quant_fp8_cuda(x, 128, None, False)),
        "compiled function only": host_us_per_call(lambda: compiled(x, q.view(torch.uint8), s)),
        "its tvm_ffi.Function only": host_us_per_call(
            lambda: compiled.__tvm_ffi_object__()(x, q.view(torch.uint8), s)
        ),
    }
    print("host overhead per eager call, T=1:  " + ";  ".join(f"{k} {v:.1f} us" for k, v in host.items()))
    write_json(args.json, {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows, "host_us": host})
    plot(rows, png, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
