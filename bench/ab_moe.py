"""Same-call A/B of the whole MoE layer: a git revision's ``cute_moe`` package against this tree's,
on ``bench_moe.py``'s cute_moe rows (CUDA graph, L2 flushed, median of ``--reps`` replays).

    python bench/ab_moe.py --rev REV [--only SUBSTR] [--ep 2,4] [--tokens 4096,8192]
                           [--rounds 2] [--reps 30]

Each side runs in its own process (a package cannot be imported twice), the two alternating over
``--rounds`` so that clock drift under the power cap hits both alike; the table gives each side's
minimum µs over the rounds per (model, T) and the change.  ``bench_moe`` seeds weights and routing
from the model's name, so both sides time the same problem.

* ``REV``: a git revision (``git archive REV cute_moe`` into a temporary directory), or a
  directory holding a ``cute_moe`` package -- the device machine's copy of the tree has no git
  history, so export it beforehand: ``mkdir -p ab_rev/base && git archive REV cute_moe | tar -x -C
  ab_rev/base``.  The revision's package goes first on ``PYTHONPATH``; each process prints the
  package it imported, and the A/B stops if a side imported the other's.
* ``--ep 2,4``: adds DeepSeek-V3 expert-parallel slices of 256 / EP local experts (bench_moe holds
  the EP8 slice only); ``--only`` filters the models by substring, as bench_moe's.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_revision(rev: str) -> str:
    """A directory whose ``cute_moe`` is the package at ``rev`` (``rev`` itself if it holds one)."""
    if os.path.isdir(os.path.join(rev, "cute_moe")):
        return os.path.abspath(rev)
    out = tempfile.mkdtemp(prefix="ab_moe_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cute_moe"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def side_env(package_dir: str | None) -> dict:
    """The environment of one side's process: ``package_dir`` (the revision's) first on the path, then
    the repository root (this tree's package, and bench_moe's imports of the repository)."""
    paths = [package_dir] if package_dir else []
    paths += [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def worker_argv(json_path: str, args) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--json", json_path, "--reps", str(args.reps),
            "--ep", args.ep]  # fmt: skip
    if args.only:
        argv += ["--only", args.only]
    if args.tokens:
        argv += ["--tokens", args.tokens]
    return argv


def run_worker(args) -> None:
    """One side: bench_moe's main on the cute_moe rows, with the extra EP slices in its model list."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_moe  # noqa: PLC0415
    import cute_moe  # noqa: PLC0415

    print(f"package: {os.path.dirname(os.path.abspath(cute_moe.__file__))}", flush=True)
    extra = [bench_moe.Model(f"DeepSeek-V3 EP{ep}", **bench_moe._DSV3, local=256 // ep)
             for ep in map(int, filter(None, args.ep.split(","))) if ep != 8]  # fmt: skip
    bench_moe.MODELS = tuple(bench_moe.MODELS) + tuple(extra)
    argv = ["--impls", "cute_moe", "--reps", str(args.reps), "--json", args.json,
            "--png", os.path.splitext(args.json)[0] + ".png"]  # fmt: skip
    if args.only:
        argv += ["--only", args.only]
    if args.tokens:
        argv += ["--tokens", args.tokens]
    bench_moe.main(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="git revision, or a directory holding its cute_moe package")
    parser.add_argument("--only", default=None, help="only models whose name contains this substring")
    parser.add_argument("--ep", default="", help="comma-separated EP degrees of DeepSeek-V3 slices to add, e.g. 2,4")
    parser.add_argument("--tokens", default=None, help="comma-separated T values (bench_moe's default otherwise)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if not args.rev:
        parser.error("--rev is required")
    rev_dir = export_revision(args.rev)
    sides = ((f"rev {args.rev}", rev_dir), ("this tree", ROOT))
    work = tempfile.mkdtemp(prefix="ab_moe_out_")
    us: dict = {}
    try:
        for r in range(args.rounds):
            for label, package_root in sides:
                path = os.path.join(work, f"{r}_{label.split()[0]}.json")
                env = side_env(rev_dir if package_root == rev_dir else None)
                proc = subprocess.run(worker_argv(path, args), env=env, cwd=ROOT, capture_output=True, text=True)
                lines = proc.stdout.splitlines()
                imported = next((ln.split(": ", 1)[1] for ln in lines if ln.startswith("package: ")), "")
                if proc.returncode != 0 or os.path.dirname(imported) != package_root:
                    sys.exit(f"{label} (round {r + 1}): rc {proc.returncode}, imported {imported!r}, expected a "
                             f"package in {package_root}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
                with open(path) as f:
                    for row in json.load(f)["rows"]:
                        if row.get("impl") == "cute_moe" and row.get("us"):
                            us.setdefault((row["model"], row["T"]), {}).setdefault(label, []).append(row["us"])
                print(f"round {r + 1}: {label} done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (base, _), (head, _) = sides
    print(f"\n{'model':>20} {'T':>6} {base[:18]:>18} {head:>12} {'change':>8}   (min µs over {args.rounds} rounds)")
    for (model, t), by_side in us.items():
        if base in by_side and head in by_side:
            a, b = min(by_side[base]), min(by_side[head])
            print(f"{model:>20} {t:>6} {a:18.1f} {b:12.1f} {100 * (b / a - 1):+7.1f}%")


if __name__ == "__main__":
    main()
