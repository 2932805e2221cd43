"""Eager host overhead of every op at decode size: mean wall time per call of
``torch.ops.cute_moe.<op>`` on the host, with inputs so small that the GPU keeps up.

    python bench/bench_host_overhead.py [--calls N]

DeepSeek-V3 shapes at T=1 (H=7168, E=256, k=8, I=2048); the KV fill is a decode step of B=1.
Two paths per op: ``torch.ops.cute_moe.<op>`` (through the dispatcher) and the functional API's
eager path (``cute_moe.<op>``: the op's CUDA implementation called directly).  Targets: <= 15 µs
per op (issue 5), <= 10 µs for grouped_gemm_fp8 (issue 3).  ``empty`` is the time of one
``torch.empty`` on the GPU in the same run, for scale.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.timing import host_us_per_call  # noqa: E402

import cute_moe  # noqa: E402  (registers torch.ops.cute_moe)

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
    off, r2t, t2r, _ = ops.align(ids, E, 128, 0, None)
    a, a_s = ops.permute_quant(x, r2t, off, None)
    b = torch.randn(E, 2 * INTER, H, device=dev).to(torch.float8_e4m3fn)
    b_s = torch.rand(E, 2 * INTER // 128, H // 128, device=dev)
    h = ops.grouped_gemm_fp8(a, a_s, b, b_s, off)
    a2, a2_s = ops.silu_mul_quant(h, off, True, None)
    y = torch.randn(a2.shape[0], H, device=dev, dtype=torch.bfloat16)
    hidden = torch.randn(1, K, H, device=dev, dtype=torch.bfloat16)
    kc = torch.zeros(16, 64, 8, 128, device=dev, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ksc = torch.zeros(16, 64, 8, 1, device=dev)
    vsc = torch.zeros_like(ksc)
    k_new = torch.randn(1, 8, 128, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    kv_len = torch.tensor([5], device=dev, dtype=torch.int32)
    blocks = torch.arange(4, device=dev, dtype=torch.int32).view(1, 4)
    return {
        "empty": lambda: torch.empty(1, H, device=dev),
        "quant_fp8": lambda: ops.quant_fp8(x, 128, None, False),
        "route": lambda: ops.route(logits, K, "deepseek_v3", bias, 8, 4, 2.5),
        "align": lambda: ops.align(ids, E, 128, 0, None),
        "permute_quant": lambda: ops.permute_quant(x, r2t, off, None),
        "grouped_gemm_fp8": lambda: ops.grouped_gemm_fp8(a, a_s, b, b_s, off),
        "silu_mul_quant": lambda: ops.silu_mul_quant(h, off, True, None),
        "finalize": lambda: ops.finalize(y, w, t2r),
        "moe_reduce": lambda: ops.moe_reduce(hidden, w, False),
        "fill_kv_cache_fp8": lambda: ops.fill_kv_cache_fp8(k_new, k_new, kc, vc, ksc, vsc, cu, kv_len, blocks,
                                                           128, None, "bshd"),  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    via_ops, direct = cases(), cases(_Direct())
    print(f"{'op':>18} {'torch.ops us':>12} {'functional us':>13}")
    for name, fn in via_ops.items():
        print(f"{name:>18} {host_us_per_call(fn, args.calls):>12.1f} {host_us_per_call(direct[name], args.calls):>13.1f}")


if __name__ == "__main__":
    main()
