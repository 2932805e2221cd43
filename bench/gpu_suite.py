"""The GPU test suite within one device call's time limit, resumable across calls.

    python bench/gpu_suite.py [--budget-s 420] [--ids LEFT_TXT] [--marker gpu] [PATH ...]

Runs ``pytest -m MARKER`` in this process over PATH (default ``tests``), or over the node ids that
``--ids`` lists (one per line: a previous call's ``left.txt``).  After each test it reads the clock,
and once ``--budget-s`` seconds have passed it stops pytest after that test, so a call that runs
out of time still knows what ran.  (A ``timeout`` around pytest kills it with its record: session
31 had to reconstruct which 34 tests two cut-off halves of the suite had not reached from
collection counts.)  Keep the device call's own limit above the budget by the longest test.

Writes under ``$OUT`` (default ``/tmp/out``): ``outcomes.txt`` (node id and outcome per test run:
passed, failed, error, skipped), ``left.txt`` (the selected node ids not reached; empty when the
selection finished).  Prints pytest's progress, then one summary line: counts per outcome, the ids
of failures and errors, and how many are left.  Exit status: 0 when the selection finished with no
failure or error, 1 on a failure or error, 2 when stopped by the budget with none.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import pytest


class BudgetPlugin:
    """Keeps the listed node ids (all when None), records each test's outcome, and asks pytest to
    stop after the first test that ends past ``deadline`` (``time.monotonic()``)."""

    def __init__(self, deadline: float, ids: list[str] | None):
        self.deadline, self.ids = deadline, ids
        self.selected: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.unknown_ids: list[str] = []
        self.session = None

    def pytest_sessionstart(self, session) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)  # after ``-m``'s deselection
    def pytest_collection_modifyitems(self, config, items) -> None:
        if self.ids is not None:
            wanted = set(self.ids)
            kept = [item for item in items if item.nodeid in wanted]
            found = {item.nodeid for item in kept}
            self.unknown_ids = [i for i in self.ids if i not in found]
            dropped = [item for item in items if item.nodeid not in wanted]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        self.selected = [item.nodeid for item in items]

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call":
            self.outcomes[report.nodeid] = report.outcome
        elif report.failed:  # setup or teardown
            self.outcomes[report.nodeid] = "error"
        elif report.skipped:  # skipped in setup (a skip mark, a missing GPU)
            self.outcomes.setdefault(report.nodeid, "skipped")

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        self.outcomes.setdefault(nodeid, "error")
        if time.monotonic() > self.deadline and self.session is not None:
            self.session.shouldstop = "gpu_suite.py: time budget spent"

    def left(self) -> list[str]:
        return [i for i in self.selected if i not in self.outcomes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tests"])
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--ids", default=None, help="run only the node ids this file lists, one per line")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu)")
    args = parser.parse_args(argv)
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    ids = None
    if args.ids is not None:
        with open(args.ids) as f:
            ids = [line.strip() for line in f if line.strip()]
    plugin = BudgetPlugin(time.monotonic() + args.budget_s, ids)
    paths = sorted({i.split("::")[0] for i in ids}) if ids else args.paths
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", args.marker, *paths], plugins=[plugin])
    with open(os.path.join(out, "outcomes.txt"), "w") as f:
        f.writelines(f"{nodeid} {outcome}\n" for nodeid, outcome in plugin.outcomes.items())
    left = plugin.left()
    with open(os.path.join(out, "left.txt"), "w") as f:
        f.writelines(f"{nodeid}\n" for nodeid in left)
    counts: dict[str, int] = {}
    for outcome in plugin.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    bad = [n for n, o in plugin.outcomes.items() if o in ("failed", "error")]
    summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "nothing ran"
    print(f"gpu_suite: {summary}; {len(left)} of {len(plugin.selected)} left (left.txt)"
          + (f"; {len(plugin.unknown_ids)} listed ids not found" if plugin.unknown_ids else "")
          + "".join(f"\n  {o.upper()} {n}" for n, o in plugin.outcomes.items() if n in bad))  # fmt: skip
    if bad or code not in (pytest.ExitCode.OK, pytest.ExitCode.INTERRUPTED, pytest.ExitCode.NO_TESTS_COLLECTED):
        return 1
    return 2 if left else 0


if __name__ == "__main__":
    sys.exit(main())
