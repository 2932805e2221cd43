"""The GPU test suite within one device call's time limit, resumable across calls.

    python bench/gpu_suite.py [--budget-s 420] [--ids LEFT_TXT] [--marker gpu] [PATH ...]

Runs ``pytest -m MARKER`` in this process over PATH (default ``tests``), or over the node ids that
``--ids`` lists (one per line: a previous call's ``left.txt``, copied back from its ``$OUT``).  After
each test it reads the clock, and once ``--budget-s`` seconds have passed it stops pytest after
that test, so a call that runs out of time still knows what ran.  (A ``timeout`` around pytest kills
it with its record: session 31 had to reconstruct which 34 tests two cut-off halves of the suite
had not reached from collection counts.)  Keep the device call's own limit above the budget by the
longest test; if the call is killed anyway, the files below are at most ``_SAVE_EVERY_S`` behind.

Writes under ``$OUT`` (default ``/tmp/out``), as it goes: ``outcomes.txt`` (node id and outcome per
test run: passed, failed, error, skipped, xfailed, xpassed), ``left.txt`` (the selected node ids
not run yet, and listed ids that were not found, e.g. in a file that failed to collect; empty when
everything ran).  Prints pytest's progress, then one summary line: counts per outcome, the ids of
failures, errors and collection errors, and how many are left.  Exit status: 0 when everything
selected ran with no failure or error, 1 on a failure, an error, a collection error or a listed id
not found, 2 when stopped by the budget with none.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import pytest

_SAVE_EVERY_S = 5.0  # how often left.txt is rewritten while tests run
_BAD = ("failed", "error")


def _write_lines(path: str, lines: list[str]) -> None:
    """Replaces the file whole (a kill mid-write leaves the previous version)."""
    with open(path + ".tmp", "w") as f:
        f.writelines(f"{line}\n" for line in lines)
    os.replace(path + ".tmp", path)


class BudgetPlugin:
    """Keeps the listed node ids (all when None), records each test's outcome as it ends, and asks
    pytest to stop after the first test that ends past ``deadline`` (``time.monotonic()``)."""

    def __init__(self, deadline: float, ids: list[str] | None, out: str):
        self.deadline, self.ids, self.out = deadline, ids, out
        self.selected: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.not_found: list[str] = []
        self.collect_errors: list[str] = []
        self.session = None
        self._record = open(os.path.join(out, "outcomes.txt"), "w")
        self._saved_at = 0.0

    def pytest_sessionstart(self, session) -> None:
        self.session = session

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors.append(report.nodeid or str(report.fspath))

    @pytest.hookimpl(trylast=True)  # after ``-m``'s deselection
    def pytest_collection_modifyitems(self, config, items) -> None:
        if self.ids is not None:
            wanted = set(self.ids)
            kept = [item for item in items if item.nodeid in wanted]
            dropped = [item for item in items if item.nodeid not in wanted]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = kept
            found = {item.nodeid for item in kept}
            self.not_found = [i for i in self.ids if i not in found]
        self.selected = [item.nodeid for item in items]
        self.save_left()

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            else:
                outcome = report.outcome
            self.outcomes[report.nodeid] = outcome
        elif report.failed:  # setup or teardown; a failed call stays "failed"
            if self.outcomes.get(report.nodeid) != "failed":
                self.outcomes[report.nodeid] = "error"
        elif report.skipped:  # skipped in setup (a skip mark, a missing GPU)
            self.outcomes.setdefault(report.nodeid, "skipped")

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        outcome = self.outcomes.setdefault(nodeid, "error")
        self._record.write(f"{nodeid} {outcome}\n")
        self._record.flush()
        now = time.monotonic()
        if now - self._saved_at > _SAVE_EVERY_S:
            self.save_left()
        if now > self.deadline and self.session is not None:
            self.session.shouldstop = "gpu_suite.py: time budget spent"

    def left(self) -> list[str]:
        return [i for i in self.selected if i not in self.outcomes] + self.not_found

    def save_left(self) -> None:
        _write_lines(os.path.join(self.out, "left.txt"), self.left())
        self._saved_at = time.monotonic()

    def close(self) -> None:
        self._record.close()
        self.save_left()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=None)
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--ids", default=None, help="run only the node ids this file lists, one per line")
    parser.add_argument("--marker", default="gpu", help="pytest -m expression (default: gpu)")
    args = parser.parse_args(argv)
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    ids, paths = None, args.paths or ["tests"]
    if args.ids is not None:
        if args.paths:
            print(f"gpu_suite: --ids given: the paths {args.paths} are ignored")
        with open(args.ids) as f:
            ids = list(dict.fromkeys(line.strip() for line in f if line.strip()))
        # Only files that exist: a missing one would make pytest refuse the whole command line.
        paths = sorted({i.split("::")[0] for i in ids if os.path.exists(i.split("::")[0])})
    plugin = BudgetPlugin(time.monotonic() + args.budget_s, ids, out)
    if ids is not None and not paths:
        plugin.not_found = ids
        code = pytest.ExitCode.NO_TESTS_COLLECTED
    else:
        # A file that fails to collect is reported (exit 1) without keeping the others from running.
        argv = ["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", "-m", args.marker, *paths]
        code = pytest.main(argv, plugins=[plugin])
    plugin.close()
    left = plugin.left()
    counts: dict[str, int] = {}
    for outcome in plugin.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    bad = [(o.upper(), n) for n, o in plugin.outcomes.items() if o in _BAD]
    bad += [("COLLECTION ERROR", n) for n in plugin.collect_errors]
    summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "nothing ran"
    print(f"gpu_suite: {summary}; {len(left)} left (left.txt)"
          + (f", of which {len(plugin.not_found)} listed ids not found" if plugin.not_found else "")
          + "".join(f"\n  {what} {n}" for what, n in bad))  # fmt: skip
    if bad or plugin.not_found or code not in (pytest.ExitCode.OK, pytest.ExitCode.INTERRUPTED,
                                               pytest.ExitCode.NO_TESTS_COLLECTED):
        return 1
    return 2 if left else 0


if __name__ == "__main__":
    sys.exit(main())
