"""route and align on the GPU: kernel time per call in a CUDA graph beside plain PyTorch.

    python bench/bench_route.py [--json PATH]

Shapes (issue 5): DeepSeek-V3 (E=256, top-8, deepseek_v3 with score bias, groups 8/4, scaling
2.5) and Qwen3-235B (E=128, top-8, renormalize), T in {1, 16, 128, 1024, 4096, 16384}, f32
logits.  ``us`` is the per-call device time of 100 back-to-back calls in one CUDA graph (the
decode figure: one graph launch's own overhead would swamp a 2 µs kernel); ``cold us`` one
replay after an L2 flush.  The plain-PyTorch composition is ``cute_moe.reference.route_ref`` /
``align_ref`` on CUDA tensors (event-timed, eager: they sync on the host).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402,F401  (registers torch.ops.cute_moe)
from cute_moe.reference import align_ref, route_ref  # noqa: E402
from cute_moe.timing import Timer  # noqa: E402
from bench_io import default_json, write_json  # noqa: E402

TOKENS = (1, 16, 128, 1024, 4096, 16384)
MODELS = {
    "DeepSeek-V3": dict(E=256, k=8, method="deepseek_v3", n_group=8, topk_group=4, scaling=2.5, bias=True),
    "Qwen3-235B": dict(E=128, k=8, method="renormalize", n_group=1, topk_group=1, scaling=1.0, bias=False),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=default_json("bench_route.json"))
    args = parser.parse_args()
    timer = Timer()
    rows = []
    for model, m in MODELS.items():
        bias = torch.randn(m["E"], device="cuda") * 0.1 if m["bias"] else None
        for t in TOKENS:
            logits = torch.randn(t, m["E"], device="cuda")
            route_args = (logits, m["k"], m["method"], bias, m["n_group"], m["topk_group"], m["scaling"])
            ops_ = torch.ops.cute_moe
            ids, _ = ops_.route(*route_args)
            ops = {
                "route": (lambda: ops_.route(*route_args), lambda: route_ref(*route_args)),
                "align": (lambda: ops_.align(ids, m["E"], 128, 0, None), lambda: align_ref(ids, m["E"], 128)),
            }
            for op, (ours, plain) in ops.items():
                rows.append({"model": model, "op": op, "T": t, "us": timer.graph_amortized_us(ours),
                             "cold_us": timer.graph_us(ours), "torch_us": timer.kernel_us(plain, reps=20)})  # fmt: skip
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'model':>12} {'op':>6} {'T':>6} {'us':>8} {'cold us':>8} {'torch us':>9}")
    for r in rows:
        print(f"{r['model']:>12} {r['op']:>6} {r['T']:>6} {r['us']:>8.2f} {r['cold_us']:>8.2f} {r['torch_us']:>9.1f}")
    write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
