"""What a tile of at most 64 real rows costs the sm90 grouped GEMM, and whether pairing such tiles
with each other would pay: the lever left at DeepSeek-V3 T = 8192 (bench/NOTES.md, session 25: a
fifth of the routed GEMMs' M tiles are segments' last tiles of <= 64 real rows).

    python bench/probe_sparse_tiles.py [--rounds 3] [--reps 30]

Problems, each DeepSeek-V3's w13 (N x K = 4096 x 7168) and w2 (7168 x 2048) over 256 experts of one
128-row segment each, with expert counts (as ``fused_moe`` runs the GEMMs):

* ``full``: every expert 128 real rows;
* ``sparse``: every expert 48 real rows (every tile at most 64: one math warp group works);
* ``alternating``: experts alternate 128 / 48 real rows, so that every M-tile pair ``(2i, 2i + 1)``
  holds one full and one sparse tile -- what a segment's last tile meets today when it pairs with
  the next segment's first;
* ``grouped``: the same counts, the full experts first: pairs are full + full or sparse + sparse,
  what a visit order that pairs sparse tiles together would give.

Variants: the 256-wide tile paired along M (the routed w13's launch at prefill) and along N (the
routed w2's), and the 128-wide tile along N.  Rounds interleave every (problem, variant); the table
gives the minimum and median µs (``Timer.graph_us``: CUDA graph, L2 flushed) and, per variant,
``sparse / full`` (a sparse tile's cost relative to a full one) and ``grouped / alternating`` (what
the pairing would save where every pair is mixed).  Each variant's real rows are checked equal to
the first variant's, bit for bit.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.kernels import grouped_gemm_sm90 as g90  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_grouped_gemm import _rand_fp8, _rand_scales, seed_from  # noqa: E402

E, TILE, SPARSE = 256, 128, 48
NK = ((4096, 7168), (7168, 2048))
VARIANTS = {"256 along M": dict(tile_n=256, along_m=True), "256 along N": dict(tile_n=256, along_m=False),
            "128 along N": dict(tile_n=128, along_m=False)}  # fmt: skip


def counts_of(problem: str) -> list[int]:
    if problem == "full":
        return [TILE] * E
    if problem == "sparse":
        return [SPARSE] * E
    mixed = [TILE if e % 2 == 0 else SPARSE for e in range(E)]
    return mixed if problem == "alternating" else sorted(mixed, reverse=True)


def operands(n: int, k: int):
    """(a, a_scale MN-major, b, b_scale, offsets) for 256 segments of 128 rows."""
    seed_from(f"probe_sparse_tiles {n}x{k}")
    m_cap, kb = E * TILE, k // TILE
    a, a_scale = _rand_fp8(m_cap, k), _rand_scales(kb, m_cap, scale=1e-2).t()
    b, b_scale = _rand_fp8(E, n, k), _rand_scales(E, -(-n // TILE), kb, scale=1e-4)
    offsets = torch.arange(0, m_cap + 1, TILE, dtype=torch.int32, device="cuda")
    return a, a_scale, b, b_scale, offsets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    timer = Timer()
    problems = ("full", "sparse", "alternating", "grouped")
    for n, k in NK:
        a, a_scale, b, b_scale, offsets = operands(n, k)
        calls, real = {}, {}
        for p in problems:
            counts = counts_of(p)
            cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
            real[p] = torch.cat([torch.arange(e * TILE, e * TILE + c, device="cuda") for e, c in enumerate(counts)])
            for v, kw in VARIANTS.items():
                calls[p, v] = (lambda cnt=cnt, kw=kw: g90.grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, offsets, cnt,
                                                                               expected_m=TILE, **kw))  # fmt: skip
        for p in problems:  # compiles every variant once; the real rows agree between variants
            first = None
            for v in VARIANTS:
                rows = calls[p, v]()[real[p]]
                if first is None:
                    first = rows
                elif not torch.equal(rows, first):
                    print(f"WARNING {n}x{k} {p}: {v}'s real rows differ from {next(iter(VARIANTS))}'s")
        times: dict = {key: [] for key in calls}
        for _ in range(args.rounds):
            for key, fn in calls.items():
                times[key].append(timer.graph_us(fn, args.reps))
        print(f"\nN x K = {n} x {k}, {E} experts x {TILE} rows, sparse tiles {SPARSE} rows (µs: min / median)")
        print(f"{'variant':>12} " + " ".join(f"{p:>18}" for p in problems) + f" {'sparse/full':>12} {'grouped/alt':>12}")
        for v in VARIANTS:
            lo = {p: min(times[p, v]) for p in problems}
            cells = " ".join(f"{lo[p]:8.1f} / {statistics.median(times[p, v]):7.1f}" for p in problems)
            print(f"{v:>12} {cells} {lo['sparse'] / lo['full']:12.3f} {lo['grouped'] / lo['alternating']:12.3f}")


if __name__ == "__main__":
    main()
