"""The MoE layer's memory-bound steps on the GPU, DeepSeek-V3 shape (H=7168, E=256,
top-8, I=2048): µs (device time of one CUDA-graph replay, L2 flushed), GB/s and
share of the copy bandwidth measured in the same run, beside the plain-PyTorch
composition (cute_moe.reference on CUDA tensors).

    python bench/bench_small_kernels.py [--json PATH]

(``%pad``: the share of the segments' rows that are padding, for the routing of that T.)

permute_quant is timed both ways: ``permute_quant[rows]`` (row_to_token only: the
row-major kernel, one gather and quantization per routed row) and
``permute_quant[tokens]`` (token_to_row given too: the token-major kernel, each
token row read and quantized once), and ``permute_quant[tok,nopad]``, the
token-major kernel with ``zero_padding=False``, as fused_moe calls it (the padding
rows left unwritten).

silu_mul_quant is timed both ways too: ``silu_mul_quant`` (expert_offsets only: every
row of every segment, padding included) and ``silu_mul_quant[counts]`` (align's
expert_counts given, as fused_moe calls it: the padding rows are neither read nor
written).

Bytes counted minimally: permute_quant reads x once (T·H·2) and writes the
routed rows' codes and scales (both ways; the padding rows both kernels zero are
not counted: about 10% more bytes at T=16384, most of them below); silu_mul_quant
reads the routed rows of h (2I bf16) and writes their codes and scales (both
ways: without counts the kernel also moves the padding rows, about 11% more
bytes at T=16384 and nearly all of them at decode sizes); finalize and
moe_reduce are in bench_finalize.py.

The header also gives the write-only bandwidth of the same GPU (a fill kernel, ~78% of the copy
figure on an H200).  It is not a bound for permute_quant, which writes about four bytes for each
one it reads: its bulk copies write faster than the fill, and a plain contiguous stream of its byte
mix reaches 88-91% of copy (bench/NOTES.md, session 14).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402
from cute_moe.reference import align_ref, permute_quant_ref, silu_mul_quant_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

H, E, K, INTER = 7168, 256, 8, 2048
TOKENS = (1, 16, 128, 1024, 4096, 16384)


def _routing(t: int):
    ids = torch.rand(t, E, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
    offsets, row_to_token, token_to_row, counts = align_ref(ids, E, 128)
    return offsets, row_to_token, token_to_row, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=default_json("bench_small_kernels.json"))
    args = parser.parse_args()
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    write_gbs = timer.write_bandwidth_gbs()
    rows = []
    for t in TOKENS:
        offsets, row_to_token, token_to_row, counts = _routing(t)
        routed = int(counts.sum())
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(row_to_token.shape[0], 2 * INTER, device="cuda", dtype=torch.bfloat16)
        pq_bytes = t * H * 2 + routed * (H + H // 128 * 4)
        silu_bytes = routed * (2 * INTER * 2 + INTER + INTER // 128 * 4)
        cases = {
            "permute_quant[rows]": (pq_bytes,
                                    lambda: cute_moe.permute_quant(x, row_to_token, offsets),
                                    lambda: permute_quant_ref(x, row_to_token, offsets)),
            "permute_quant[tokens]": (pq_bytes,
                                      lambda: cute_moe.permute_quant(x, row_to_token, offsets,
                                                                     token_to_row=token_to_row),
                                      lambda: permute_quant_ref(x, row_to_token, offsets)),
            "permute_quant[tok,nopad]": (pq_bytes,
                                         lambda: cute_moe.permute_quant(x, row_to_token, offsets,
                                                                        token_to_row=token_to_row,
                                                                        zero_padding=False),
                                         lambda: permute_quant_ref(x, row_to_token, offsets)),
            "silu_mul_quant": (silu_bytes,
                               lambda: cute_moe.silu_mul_quant(h, offsets),
                               lambda: silu_mul_quant_ref(h, offsets)),
            "silu_mul_quant[counts]": (silu_bytes,
                                       lambda: cute_moe.silu_mul_quant(h, offsets, expert_counts=counts),
                                       lambda: silu_mul_quant_ref(h, offsets)),
        }
        for name, (nbytes, ours, plain) in cases.items():
            us = timer.graph_us(ours)
            plain_us = timer.kernel_us(plain, reps=20)  # host syncs inside: events, not a graph
            rows.append({"op": name, "T": t, "us": us, "gbs": nbytes / us / 1e3,
                         "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs, "torch_us": plain_us,
                         "padding_pct": 100 * (1 - routed / max(int(offsets[-1]), 1))})
    print(f"device: {torch.cuda.get_device_name()}   copy bandwidth (read+write): {copy_gbs:.0f} GB/s   "
          f"write-only (fill): {write_gbs:.0f} GB/s = {100 * write_gbs / copy_gbs:.1f}% of copy")
    print(f"{'op':>24} {'T':>6} {'us':>8} {'GB/s':>7} {'%copy':>6} {'torch us':>9} {'speedup':>7} {'%pad':>5}")
    for r in rows:
        print(f"{r['op']:>24} {r['T']:>6} {r['us']:>8.2f} {r['gbs']:>7.0f} {r['pct_copy']:>6.1f} "
              f"{r['torch_us']:>9.1f} {r['torch_us'] / r['us']:>7.1f} {r['padding_pct']:>5.1f}")
    write_json(args.json, {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "write_gbs": write_gbs,
                           "rows": rows})


if __name__ == "__main__":
    main()
