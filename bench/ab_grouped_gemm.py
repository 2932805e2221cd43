"""Same-run A/B of grouped_gemm_fp8 kernel variants on the GPU: µs per shape and variant over
several rounds, and whether each variant's output equals the first's bit for bit on the rows the
contract defines (below ``expert_offsets[-1]``; with expert counts, the real rows only).

    python bench/ab_grouped_gemm.py [--rev REV] [--variant KEY=VAL[,KEY=VAL]] ... [--only SUBSTR] ...
                                    [--rounds N] [--reps N]

Variants, in this order:

* ``REV`` (``--rev``): the sm90 kernel and its schedule module as they were at git revision REV,
  loaded beside this tree's as ``cute_moe.kernels._ab_rev_*`` (nothing is written to the tree);
  the revision's kernel must take the same launch arguments.  Where the tree has no git history
  (the device machine's copy), REV may be a directory holding the two files, exported beforehand:
  ``mkdir ab_rev; for f in grouped_gemm_sm90 grouped_gemm_schedule; do git show
  REV:cute_moe/kernels/$f.py > ab_rev/$f.py; done``;
* ``this tree``, the kernel as checked out, with the shape rules it applies;
* one per ``--variant``: this tree's kernel with keyword overrides of ``grouped_gemm_fp8_cuda``
  (``along_m=1``, ``block_scaled=0``, ...), e.g. to force either cluster direction.

Shapes: ``bench_grouped_gemm.shapes()`` (contiguous, EP, decode, routed), filtered by ``--only``.
Per shape, rounds interleave the variants, so that clock drift under the power cap hits all of
them alike; the table gives each variant's minimum and median, and its ratio of minima to the
first variant's.  Timing: ``Timer.graph_us`` (CUDA graph, L2 flushed, median of reps).
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cute_moe.timing import Timer  # noqa: E402
from bench_grouped_gemm import make_problem, shapes  # noqa: E402

_KERNEL, _SCHEDULE = "cute_moe/kernels/grouped_gemm_sm90.py", "cute_moe/kernels/grouped_gemm_schedule.py"


def _revision_source(rev: str, path: str) -> str:
    if os.path.isdir(rev):
        with open(os.path.join(rev, os.path.basename(path))) as f:
            return f.read()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", "-C", root, "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout


def load_revision(rev: str):
    """The sm90 kernel module at git revision ``rev`` (or from the directory ``rev``), with that
    revision's schedule module, imported inside the ``cute_moe.kernels`` package (their relative
    imports resolve there)."""
    sources = {path: _revision_source(rev, path) for path in (_KERNEL, _SCHEDULE)}
    sources[_KERNEL] = sources[_KERNEL].replace("from .grouped_gemm_schedule import", "from ._ab_rev_schedule import")
    # The files outlive the import: the DSL reads a kernel's source when it first compiles it.
    tmp = tempfile.mkdtemp(prefix="ab_rev_")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    modules = []
    for path, name in ((_SCHEDULE, "_ab_rev_schedule"), (_KERNEL, "_ab_rev_sm90")):
        file = os.path.join(tmp, name + ".py")
        with open(file, "w") as f:
            f.write(sources[path])
        spec = importlib.util.spec_from_file_location(f"cute_moe.kernels.{name}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[-1]


def parse_variant(text: str) -> dict:
    """``"along_m=1,block_scaled=0"`` -> ``{"along_m": True, "block_scaled": False}`` (0/1 are
    booleans, other integers stay integers)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"--variant: expected KEY=VAL[,KEY=VAL], got {text!r}")
        out[key] = {"0": False, "1": True}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    return out


def defined_rows(p) -> torch.Tensor:
    """Indices of the output rows the contract defines: below expert_offsets[-1], and with expert
    counts only each segment's first counts[e] rows (its padding rows are unspecified)."""
    if p.expert_counts is None:
        return torch.arange(p.end, device=p.offsets.device)
    starts = p.offsets[:-1].tolist()
    return torch.cat([torch.arange(s, s + c, device=p.offsets.device) for s, c in zip(starts, p.counts)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=None, help="also run the kernel as it was at this git revision (first)")
    parser.add_argument("--variant", action="append", type=parse_variant, default=[],
                        help="this tree's kernel with keyword overrides, e.g. along_m=1")  # fmt: skip
    parser.add_argument("--only", action="append", default=None,
                        help="only shapes whose name contains this substring (repeatable: any of them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    from cute_moe.kernels import grouped_gemm_sm90  # noqa: PLC0415 (needs the CuTe DSL)

    variants = []
    if args.rev:
        variants.append((f"rev {args.rev}", load_revision(args.rev).grouped_gemm_fp8_cuda, {}))
    variants.append(("this tree", grouped_gemm_sm90.grouped_gemm_fp8_cuda, {}))
    variants += [(",".join(f"{k}={v}" for k, v in kw.items()), grouped_gemm_sm90.grouped_gemm_fp8_cuda, kw)
                 for kw in args.variant]  # fmt: skip

    selected = [s for s in shapes() if args.only is None or any(o in s.name for o in args.only)]
    if not selected:
        sys.exit(f"no shape matches --only {args.only!r}")
    print(f"device: {torch.cuda.get_device_name()}   variants: {[v[0] for v in variants]}")
    print(f"{'shape':>28} {'variant':>24} {'min µs':>9} {'median':>9} {'ratio':>6}  output = first variant's")
    timer = Timer()
    for s in selected:  # one problem in memory at a time (E=256 weights are up to 7.5 GB)
        p = make_problem(s)
        launch_args = (p.a, p.a_scale, p.b, p.b_scale, p.offsets, p.expert_counts)
        rows = defined_rows(p)
        outs = [fn(*launch_args, **kw)[rows].view(torch.int16) for _, fn, kw in variants]
        times = [[] for _ in variants]
        for _ in range(args.rounds):
            for (_, fn, kw), t in zip(variants, times):
                t.append(timer.graph_us(lambda: fn(*launch_args, **kw), reps=args.reps))
        for (label, _, _), t, out in zip(variants, times, outs):
            print(f"{s.name:>28} {label[:24]:>24} {min(t):9.1f} {statistics.median(t):9.1f} "
                  f"{min(t) / min(times[0]):6.3f}  {'yes' if torch.equal(out, outs[0]) else 'NO'}", flush=True)  # fmt: skip
        p = launch_args = outs = None  # freed before the next shape's problem is built
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
