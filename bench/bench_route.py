"""route and align on the GPU: kernel time per call in a CUDA graph beside plain PyTorch.

    python bench/bench_route.py [--json PATH]

Shapes (issue 5): DeepSeek-V3 (E=256, top-8, deepseek_v3 with score bias, groups 8/4, scaling
2.5) and Qwen3-235B (E=128, top-8, renormalize), T in {1, 16, 128, 1024, 4096, 16384}, f32
logits.  ``us`` is the per-call device time of 100 back-to-back calls in one CUDA graph (the
decode figure: one graph launch's own overhead would swamp a 2 µs kernel); ``cold us`` one
replay after an L2 flush.  The plain-PyTorch composition is ``cute_moe.reference.route_ref`` /
``align_ref`` on CUDA tensors (event-timed, eager: they sync on the host).  ``bench_small_kernels.py``
times the same cases (``route_align_cases``) beside every other small kernel, with their bytes.

Bytes counted minimally (the JSON's ``bytes``): route reads the f32 logits (and the f32 score
bias) and writes the int32 ids and f32 weights; align reads the int32 ids and writes its four int32
outputs, ``row_to_token`` whole (M_cap entries: the padding rows' -1 are part of its result).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402,F401  (registers torch.ops.cute_moe)
from cute_moe.reference import align_ref, m_cap, route_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

TOKENS = (1, 16, 128, 1024, 4096, 16384)
MODELS = {
    "DeepSeek-V3": dict(E=256, k=8, method="deepseek_v3", n_group=8, topk_group=4, scaling=2.5, bias=True),
    "Qwen3-235B": dict(E=128, k=8, method="renormalize", n_group=1, topk_group=1, scaling=1.0, bias=False),
}
ALIGNMENT = 128  # the GEMM's rows per tile, as fused_moe aligns


def route_bytes(t: int, e: int, k: int, bias: bool) -> int:
    """logits [T, E] f32 (and the score bias [E] f32) read; ids [T, k] int32 and weights [T, k] f32 written."""
    return t * e * 4 + (e * 4 if bias else 0) + t * k * 8


def align_bytes(t: int, k: int, e: int) -> int:
    """ids [T, k] read; expert_offsets [E+1], row_to_token [M_cap], token_to_row [T, k], counts [E] written."""
    return t * k * 4 + (e + 1) * 4 + m_cap(t, k, e, ALIGNMENT) * 4 + t * k * 4 + e * 4


def route_align_cases(m: dict, t: int, device: str = "cuda") -> dict:
    """op -> (bytes, cute_moe's call, the plain-PyTorch call) for route and align at T=t, on random
    f32 logits (and score bias); align takes route's ids."""
    bias = torch.randn(m["E"], device=device) * 0.1 if m["bias"] else None
    logits = torch.randn(t, m["E"], device=device)
    route_args = (logits, m["k"], m["method"], bias, m["n_group"], m["topk_group"], m["scaling"])
    ops = torch.ops.cute_moe
    ids, _ = ops.route(*route_args)
    return {
        "route": (route_bytes(t, m["E"], m["k"], m["bias"]),
                  lambda: ops.route(*route_args), lambda: route_ref(*route_args)),
        "align": (align_bytes(t, m["k"], m["E"]),
                  lambda: ops.align(ids, m["E"], ALIGNMENT, 0, None), lambda: align_ref(ids, m["E"], ALIGNMENT)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=default_json("bench_route.json"))
    args = parser.parse_args()
    timer = Timer()
    rows = []
    for model, m in MODELS.items():
        for t in TOKENS:
            for op, (nbytes, ours, plain) in route_align_cases(m, t).items():
                rows.append({"model": model, "op": op, "T": t, "us": timer.graph_amortized_us(ours),
                             "cold_us": timer.graph_us(ours), "torch_us": timer.kernel_us(plain, reps=20),
                             "bytes": nbytes})  # fmt: skip
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'model':>12} {'op':>6} {'T':>6} {'us':>8} {'cold us':>8} {'torch us':>9}")
    for r in rows:
        print(f"{r['model']:>12} {r['op']:>6} {r['T']:>6} {r['us']:>8.2f} {r['cold_us']:>8.2f} {r['torch_us']:>9.1f}")
    write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
