"""Same-run A/B of ``grouped_gemm_fp8_swiglu``'s one sm90 kernel against its two-kernel form
(``grouped_gemm_fp8`` then ``silu_mul_quant``) on decode routings, with expert counts and
``fused_moe``'s ``expected_m`` (``T * 8 // E``), as the layer runs them:

    python bench/ab_swiglu.py [--tokens 1,4,16,...] [--model dsv3|qwen3|e16 ...] [--tile 128|256]
                              [--no-expected-m] [--rounds N] [--reps N]

``--tile`` forces the one kernel's width (``grouped_gemm_sm90.grouped_gemm_fp8_swiglu_cuda``'s
``tile_n``) where the op's rule would run two kernels or the other width.  ``--no-expected-m``
calls both forms without ``expected_m``, as an expert-parallel slice called without the global
expert count is (``fused_moe_routed`` without ``num_experts``): under 64 experts the rules then
keep the 128-wide tile at any size, e.g. ``--model e16`` (Qwen3-30B-A3B's w13 on 16 experts, an
EP8 slice's count) at prefill, where the 128-wide tiles are dense.

Per shape, rounds alternate the forms (clock drift under the power cap hits them alike): the two
kernels, the op (its rule's choice: ``sm90_swiglu_tile``'s width, or the two kernels), and with
``--tile`` the one kernel of that width forced.  The table gives each form's minimum and median µs
(``Timer.graph_us``: CUDA graph, L2 flushed, median of reps), each one's ratio of minima to the two
kernels', the width the op's rule took, and whether the real rows' codes and scales are the same
bits in every form.
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
from ab_grouped_gemm import defined_rows  # noqa: E402
from bench_grouped_gemm import DSV3_TOPK, Shape, make_problem  # noqa: E402

# (experts, 2I, H): the w13 GEMM of each model
MODELS = {"dsv3": (256, 4096, 7168), "qwen3": (128, 1536, 2048), "e16": (16, 1536, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,128,256,512")
    parser.add_argument("--model", action="append", choices=sorted(MODELS), default=None)
    parser.add_argument("--tile", type=int, choices=(gs.TILE_N, gs.WIDE_TILE_N), default=None)
    parser.add_argument("--no-expected-m", action="store_true", help="call both forms without expected_m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    op, timer = torch.ops.cute_moe, Timer()
    forms = ["two kernels", "op"] + ([f"{args.tile} forced"] if args.tile else [])
    print(f"{'shape':<24} {'op tile':>7} " + " ".join(f"{f + ' min/med':>20}" for f in forms)
          + " " + " ".join(f"{f + ' / two':>16}" for f in forms[1:]) + "  same bits")  # fmt: skip
    for model in args.model or ["dsv3"]:
        E, N, K = MODELS[model]
        for t in (int(x) for x in args.tokens.split(",")):
            p = make_problem(Shape(f"{model} w13 T={t}", "decode", E, N, K, tokens=t))
            cnt, expected_m = p.expert_counts, None if args.no_expected_m else t * DSV3_TOPK // E
            w13 = (p.a, p.a_scale, p.b, p.b_scale, p.offsets, cnt)

            def two():
                h = op.grouped_gemm_fp8(*w13, expected_m)
                return op.silu_mul_quant(h, p.offsets, True, None, cnt)

            fns = {"two kernels": two, "op": lambda: op.grouped_gemm_fp8_swiglu(*w13, True, None, expected_m)}
            if args.tile:
                fns[forms[2]] = lambda: g90.grouped_gemm_fp8_swiglu_cuda(*w13, True, None, expected_m, args.tile)
            real = defined_rows(p)
            outs = {f: fns[f]() for f in forms}
            q2, s2 = outs["two kernels"]
            same = all(torch.equal(s[real], s2[real]) and torch.equal(q[real].view(torch.uint8), q2[real].view(torch.uint8))
                       for q, s in outs.values())  # fmt: skip
            times = {f: [] for f in forms}
            for _ in range(args.rounds):
                for f in forms:
                    times[f].append(timer.graph_us(fns[f], args.reps))
            mins = {f: min(v) for f, v in times.items()}
            tile = gs.sm90_swiglu_tile(p.m_cap, E, K, True, expected_m)
            print(f"{p.shape.name:<24} {tile or 'two':>7} "
                  + " ".join(f"{mins[f]:>9.1f} / {statistics.median(times[f]):>8.1f}" for f in forms) + " "
                  + " ".join(f"{mins[f] / mins['two kernels']:>16.3f}" for f in forms[1:])
                  + f"  {'yes' if same else 'NO'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
