"""What a tile of at most 64 real rows costs the sm90 grouped GEMM, and whether pairing such tiles
with each other would pay: the lever left at DeepSeek-V3 T = 8192 (bench/NOTES.md, session 25: a
fifth of the routed GEMMs' M tiles are segments' last tiles of <= 64 real rows).

    python bench/probe_sparse_tiles.py [--rounds 3] [--reps 30] [--set one|xy|both]

Each problem is DeepSeek-V3's w13 (N x K = 4096 x 7168) and w2 (7168 x 2048) over 256 experts, run
with expert counts (as ``fused_moe`` runs the GEMMs).  Two sets:

* ``one`` (every expert one 128-row segment: each weight tile serves one M tile, so the GEMM
  streams weights from DRAM):

  - ``full``: every expert 128 real rows; ``sparse``: every expert 48 (every tile at most 64 rows:
    one math warp group works);
  - ``alternating``: experts alternate 128 / 48, so that every M-tile pair ``(2i, 2i + 1)`` holds
    one full and one sparse tile; ``grouped``: the same counts, full experts first, so that pairs
    are full + full or sparse + sparse.

* ``xy`` (compute-bound, as at T = 8192: 128 experts X of three full tiles, 384 rows, whose weight
  tiles serve three M tiles, and 128 experts Y of one tile, 512 M tiles in all):

  - ``alternating``: X Y X Y ..., Y holding 48 real rows: the pairs are X's first two tiles (one
    expert: the weight tile shared) and X's last with Y's only (full + sparse), what a segment's
    last tile meets today; ``alternating, Y full``: the same with Y holding 128 rows;
  - ``grouped``: X X Y Y ...: the pairs are X's first two, X's last with the next X's first, the
    next X's last two, and Y with Y (sparse + sparse), with the same sharing of weight tiles;
    what a visit order that pairs sparse tiles together would give; ``grouped, Y full``: the same
    order with Y full.

Variants: the 256-wide tile paired along M (the routed w13's launch at prefill) and along N (the
routed w2's), and the 128-wide tile along N.  Rounds interleave every (problem, variant); the table
gives the minimum and median µs (``Timer.graph_us``: CUDA graph, L2 flushed) and per variant the
ratios of minima that answer the question: ``one``: ``sparse / full`` (a sparse tile against a full
one) and ``grouped / alternating``; ``xy``: ``alt / alt Y full`` (what the sparse tiles save when
each rides with a full one) and ``grp / alt`` (what pairing them together saves; ``grp full / alt
full`` beside it: the order alone).  Each variant's real rows are checked equal to the first
variant's, bit for bit.
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


def problems_of(which: str) -> dict[str, list[tuple[int, int]]]:
    """name -> (segment rows, real rows) per expert, in expert order."""
    if which == "one":
        mixed = [(TILE, TILE if e % 2 == 0 else SPARSE) for e in range(E)]
        return {"full": [(TILE, TILE)] * E, "sparse": [(TILE, SPARSE)] * E, "alternating": mixed,
                "grouped": sorted(mixed, reverse=True)}  # fmt: skip
    x = (3 * TILE, 3 * TILE)
    out = {}
    for y_rows, tag in ((SPARSE, ""), (TILE, ", Y full")):
        y = (TILE, y_rows)
        out["alternating" + tag] = [x, y] * (E // 2)
        out["grouped" + tag] = [x, x, y, y] * (E // 4)
    return out


def operands(n: int, k: int, m_cap: int):
    """(a, a_scale MN-major, b, b_scale) for ``m_cap`` rows over 256 experts."""
    seed_from(f"probe_sparse_tiles {n}x{k}")
    kb = k // TILE
    a, a_scale = _rand_fp8(m_cap, k), _rand_scales(kb, m_cap, scale=1e-2).t()
    b, b_scale = _rand_fp8(E, n, k), _rand_scales(E, -(-n // TILE), kb, scale=1e-4)
    return a, a_scale, b, b_scale


def print_table(n: int, k: int, which: str, problems: dict, times: dict) -> None:
    names = list(problems)
    print(f"\nN x K = {n} x {k}, set {which!r}, sparse tiles {SPARSE} rows (µs: min / median)")
    if which == "one":
        ratios = (("sparse/full", "sparse", "full"), ("grouped/alt", "grouped", "alternating"))
    else:
        ratios = (("alt/alt Y full", "alternating", "alternating, Y full"), ("grp/alt", "grouped", "alternating"),
                  ("grp full/alt full", "grouped, Y full", "alternating, Y full"))  # fmt: skip
    print(f"{'variant':>12} " + " ".join(f"{p:>20}" for p in names) + "".join(f" {r[0]:>17}" for r in ratios))
    for v in VARIANTS:
        lo = {p: min(times[p, v]) for p in names}
        cells = " ".join(f"{lo[p]:9.1f} / {statistics.median(times[p, v]):8.1f}" for p in names)
        print(f"{v:>12} {cells}" + "".join(f" {lo[num] / lo[den]:17.3f}" for _, num, den in ratios))


def run_set(timer: Timer, which: str, n: int, k: int, rounds: int, reps: int) -> None:
    problems = problems_of(which)
    m_cap = sum(seg for seg, _ in next(iter(problems.values())))
    a, a_scale, b, b_scale = operands(n, k, m_cap)
    calls, real = {}, {}
    for p, segments in problems.items():
        starts = [0]
        for seg, _ in segments:
            starts.append(starts[-1] + seg)
        offsets = torch.tensor(starts, dtype=torch.int32, device="cuda")
        cnt = torch.tensor([rows for _, rows in segments], dtype=torch.int32, device="cuda")
        real[p] = torch.cat([torch.arange(s, s + rows, device="cuda") for s, (_, rows) in zip(starts, segments)])
        for v, kw in VARIANTS.items():
            calls[p, v] = (lambda off=offsets, cnt=cnt, kw=kw: g90.grouped_gemm_fp8_cuda(
                a, a_scale, b, b_scale, off, cnt, expected_m=TILE, **kw))  # fmt: skip
    for p in problems:  # compiles every variant once; the real rows agree between variants
        first = None
        for v in VARIANTS:
            rows = calls[p, v]()[real[p]]
            if first is None:
                first = rows
            elif not torch.equal(rows, first):
                print(f"WARNING {n}x{k} {p}: {v}'s real rows differ from {next(iter(VARIANTS))}'s")
    times: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(timer.graph_us(fn, reps))
    print_table(n, k, which, problems, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--set", choices=("one", "xy", "both"), default="both")
    args = parser.parse_args()
    timer = Timer()
    for which in (("one", "xy") if args.set == "both" else (args.set,)):
        for n, k in NK:
            run_set(timer, which, n, k, args.rounds, args.reps)


if __name__ == "__main__":
    main()
