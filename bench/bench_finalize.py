"""finalize and moe_reduce on the GPU: kernel time, bandwidth, share of the measured copy
bandwidth, and the plain-PyTorch reference composition on CUDA tensors in the same run.

    python bench/bench_finalize.py [--json PATH]

The kernels are called through the functional API (``cute_moe.finalize``, ``cute_moe.moe_reduce``:
the op's checks on the host, then its launch function; a graph replay runs the kernel alone).
Bytes counted minimally: finalize reads the k named rows of y (DeepSeek-V3 shape: E=256, k=8,
H=7168, rows from align_ref on random top-k ids), the k indices and weights per token, and writes
one bf16 row; moe_reduce reads [T, k, H] and the weights and writes [T, H].
``bench_small_kernels.py`` times the same cases (these functions) at Qwen3-235B's shape too,
beside every other small kernel.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402
from cute_moe.reference import align_ref, finalize_ref, moe_reduce_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

H, K, E = 7168, 8, 256
TOKENS = (1, 16, 128, 1024, 4096, 16384)


def random_routing(t: int, e: int, k: int, device: str = "cuda"):
    """align_ref's (expert_offsets, row_to_token, token_to_row, counts) for uniform random top-k ids
    (k distinct experts of e per token), segments padded to 128 rows."""
    ids = torch.rand(t, e, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    return align_ref(ids, e, 128)


def finalize_bytes(t: int, h: int, k: int, routed_rows: int) -> int:
    """The routed rows of y (bf16) and each token's k int32 rows and k f32 weights read; one bf16 row
    per token written."""
    return routed_rows * h * 2 + t * k * 8 + t * h * 2


def moe_reduce_bytes(t: int, k: int, h: int, elem_size: int) -> int:
    """hidden [T, k, H] and the f32 weights [T, k] read; [T, H] written, in hidden's dtype."""
    return t * k * h * elem_size + t * k * 4 + t * h * elem_size


def finalize_case(routing, h: int):
    """(bytes, cute_moe's call, the plain-PyTorch call) of finalize on ``routing`` (random_routing's, on
    its device): y [M_cap, H] bf16 and f32 weights, random."""
    _, row_to_token, token_to_row, _ = routing
    t, k = token_to_row.shape
    y = torch.randn(row_to_token.shape[0], h, device=token_to_row.device, dtype=torch.bfloat16)
    w = torch.rand(t, k, device=token_to_row.device)
    nbytes = finalize_bytes(t, h, k, int((token_to_row >= 0).sum()))
    return nbytes, lambda: cute_moe.finalize(y, w, token_to_row), lambda: finalize_ref(y, w, token_to_row)


def moe_reduce_cases(t: int, k: int, h: int, device: str = "cuda") -> dict:
    """fp32_acc -> (bytes, cute_moe's call, the plain-PyTorch call) of moe_reduce on one bf16 hidden
    [T, k, H]; the plain composition accumulates in f32 both ways."""
    hidden = torch.randn(t, k, h, device=device, dtype=torch.bfloat16)
    w = torch.rand(t, k, device=device)
    nbytes = moe_reduce_bytes(t, k, h, hidden.element_size())

    def case(fp32_acc: bool):
        ours = lambda: cute_moe.moe_reduce(hidden, w, fp32_acc=fp32_acc)  # noqa: E731
        return nbytes, ours, lambda: moe_reduce_ref(hidden, w, True)

    return {fp32_acc: case(fp32_acc) for fp32_acc in (True, False)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=default_json("bench_finalize.json"))
    args = parser.parse_args()
    timer = Timer()
    copy_gbs = timer.copy_bandwidth_gbs()
    rows = []

    def row(op, t, fp32_acc, nbytes, ours, plain):
        us = timer.graph_us(ours)
        rows.append({
            "op": op, "T": t, "H": H, "k": K, "fp32_acc": fp32_acc, "us": us, "bytes": nbytes,
            "gbs": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs,
            "torch_us": timer.graph_us(plain),
        })  # fmt: skip

    for t in TOKENS:
        row("finalize", t, None, *finalize_case(random_routing(t, E, K), H))
        torch.cuda.empty_cache()
    for t in TOKENS:
        for fp32_acc, case in moe_reduce_cases(t, K, H).items():
            row("moe_reduce", t, fp32_acc, *case)
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
