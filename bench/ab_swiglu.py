"""Same-run A/B of ``grouped_gemm_fp8_swiglu``'s one sm90 kernel against its two-kernel form
(``grouped_gemm_fp8`` then ``silu_mul_quant``) on decode routings, with expert counts and
``fused_moe``'s ``expected_m`` (``T * 8 // E``), as the layer runs them:

    python bench/ab_swiglu.py [--tokens 1,4,16,...] [--model dsv3|qwen3 ...] [--tile 128|256]
                              [--rounds N] [--reps N]

``--tile`` forces the one kernel's width (``grouped_gemm_sm90.grouped_gemm_fp8_swiglu_cuda``'s
``tile_n``) where the op's rule would run two kernels or the other width.

Per shape, rounds alternate the two forms (clock drift under the power cap hits both alike); the
table gives each form's minimum and median µs (``Timer.graph_us``: CUDA graph, L2 flushed, median of
reps), the ratio of minima, the tile width the op's rule took, and whether the real rows' codes and
scales are the same bits in both.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402,F401  (registers torch.ops.cute_moe)
from cute_moe.kernels import grouped_gemm_schedule as gs  # noqa: E402
from cute_moe.kernels import grouped_gemm_sm90 as g90  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_grouped_gemm import DSV3_TOPK, Shape, make_problem  # noqa: E402

# (experts, 2I, H): the w13 GEMM of each model
MODELS = {"dsv3": (256, 4096, 7168), "qwen3": (128, 1536, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,128,256,512")
    parser.add_argument("--model", action="append", choices=sorted(MODELS), default=None)
    parser.add_argument("--tile", type=int, choices=(gs.TILE_N, gs.WIDE_TILE_N), default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    op, timer = torch.ops.cute_moe, Timer()
    print(f"{'shape':<26} {'tile':>4} {'two kernels min/med':>20} {'one kernel min/med':>19} {'one/two':>8}  same bits")
    for model in args.model or ["dsv3"]:
        E, N, K = MODELS[model]
        for t in (int(x) for x in args.tokens.split(",")):
            p = make_problem(Shape(f"{model} w13 T={t}", "decode", E, N, K, tokens=t))
            cnt, expected_m = p.expert_counts, t * DSV3_TOPK // E
            tile = args.tile or gs.sm90_swiglu_tile(p.m_cap, E, K, True, expected_m)

            def two():
                h = op.grouped_gemm_fp8(p.a, p.a_scale, p.b, p.b_scale, p.offsets, cnt, expected_m)
                return op.silu_mul_quant(h, p.offsets, True, None, cnt)

            def one():
                if args.tile:
                    return g90.grouped_gemm_fp8_swiglu_cuda(p.a, p.a_scale, p.b, p.b_scale, p.offsets, cnt, True, None,
                                                            expected_m, args.tile)  # fmt: skip
                return op.grouped_gemm_fp8_swiglu(p.a, p.a_scale, p.b, p.b_scale, p.offsets, cnt, True, None,
                                                  expected_m)  # fmt: skip

            real = torch.zeros(p.m_cap, dtype=torch.bool, device="cuda")
            for lo, c in zip(p.offsets.tolist(), p.counts):
                real[lo : lo + c] = True
            (q2, s2), (q1, s1) = two(), one()
            same = torch.equal(s1[real], s2[real]) and torch.equal(q1[real].view(torch.uint8), q2[real].view(torch.uint8))
            times = {"two": [], "one": []}
            for _ in range(args.rounds):
                for name, fn in (("two", two), ("one", one)):
                    times[name].append(timer.graph_us(fn, args.reps))
            (m2, d2), (m1, d1) = ((min(v), statistics.median(v)) for v in (times["two"], times["one"]))
            print(f"{p.shape.name:<26} {tile or '-':>4} {m2:>9.1f} / {d2:>8.1f} {m1:>8.1f} / {d1:>8.1f} {m1 / m2:>8.3f}  "
                  f"{'yes' if same else 'NO'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
