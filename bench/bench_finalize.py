"""finalize and moe_reduce on the GPU: kernel time, bandwidth, share of the measured copy
bandwidth, and the plain-PyTorch reference composition on CUDA tensors in the same run.

    python bench/bench_finalize.py [--json PATH]

The kernels are called through their launch functions (``finalize_cuda``,
``moe_reduce_cuda``). Bytes counted minimally: finalize reads the k named rows of y
(DeepSeek-V3 shape: E=256, k=8, H=7168, rows from align_ref on random top-k ids),
the k indices and weights per token, and writes one bf16 row; moe_reduce reads
[T, k, H] and the weights and writes [T, H].
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.kernels.finalize import finalize_cuda  # noqa: E402
from cute_moe.kernels.moe_reduce import moe_reduce_cuda  # noqa: E402
from cute_moe.reference import align_ref, finalize_ref, moe_reduce_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

H, K, E = 7168, 8, 256
TOKENS = (1, 128, 4096, 16384)


def _finalize_inputs(t: int):
    ids = torch.rand(t, E, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
    _, r2t, t2r, _ = align_ref(ids, E, 128)
    y = torch.randn(r2t.shape[0], H, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(t, K, device="cuda")
    nbytes = int((t2r >= 0).sum()) * H * 2 + t * K * 8 + t * H * 2
    return (y, w, t2r), nbytes


def _moe_reduce_inputs(t: int, dtype: torch.dtype):
    hidden = torch.randn(t, K, H, device="cuda", dtype=dtype)
    w = torch.rand(t, K, device="cuda")
    e = hidden.element_size()
    return (hidden, w), t * K * H * e + t * K * 4 + t * H * e


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=default_json("bench_finalize.json"))
    args = parser.parse_args()
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    cases = [("finalize", t, None) for t in TOKENS]
    cases += [("moe_reduce", t, acc) for t in TOKENS for acc in (True, False)]
    rows = []
    for op, t, fp32_acc in cases:
        if op == "finalize":
            inputs, nbytes = _finalize_inputs(t)
            ours, plain = (lambda: finalize_cuda(*inputs)), (lambda: finalize_ref(*inputs))
        else:
            inputs, nbytes = _moe_reduce_inputs(t, torch.bfloat16)
            ours = lambda: moe_reduce_cuda(*inputs, fp32_acc)  # noqa: E731
            plain = lambda: moe_reduce_ref(*inputs, True)  # noqa: E731
        us = timer.graph_us(ours)
        rows.append({
            "op": op, "T": t, "H": H, "k": K, "fp32_acc": fp32_acc, "us": us, "bytes": nbytes,
            "gbs": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs,
            "torch_us": timer.graph_us(plain),
        })  # fmt: skip
        del inputs
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    print(f"{'op':>10} {'acc':>5} {'T':>6} {'us':>9} {'GB/s':>7} {'%copy':>6} {'torch us':>9} {'speedup':>7}")
    for r in rows:
        acc = "" if r["fp32_acc"] is None else ("f32" if r["fp32_acc"] else "bf16")
        print(f"{r['op']:>10} {acc:>5} {r['T']:>6} {r['us']:>9.2f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{r['torch_us']:>9.2f} {r['torch_us'] / r['us']:>7.1f}")
    write_json(args.json, {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows})


if __name__ == "__main__":
    main()
