"""bench/gpu_suite.py on a small synthetic suite (CPU): the budget stops pytest after a test, the
record says what ran and what is left, and a second call over ``left.txt`` finishes the selection."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "bench", "gpu_suite.py")

SUITE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_first():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_setup_error(broken):
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_last(n):
    pass
'''


def run_tool(cwd, out, *args):
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run([sys.executable, TOOL, "--marker", "", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def read_outcomes(out):
    return dict(line.split() for line in (out / "outcomes.txt").read_text().splitlines())


def test_budget_stops_after_a_test_and_the_rest_resumes(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SUITE)
    first, second = tmp_path / "out1", tmp_path / "out2"
    # A spent budget: the first test runs, then pytest stops.
    r = run_tool(tmp_path, first, "--budget-s", "0", "test_synthetic.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert read_outcomes(first) == {"test_synthetic.py::test_first": "passed"}
    left = (first / "left.txt").read_text().split()
    assert left == ["test_synthetic.py::test_fails", "test_synthetic.py::test_skipped",
                    "test_synthetic.py::test_setup_error", "test_synthetic.py::test_last[1]",
                    "test_synthetic.py::test_last[2]"]  # fmt: skip
    assert "1 passed; 5 of 6 left" in r.stdout
    # The second call runs exactly what was left, and names the failure and the error.
    r = run_tool(tmp_path, second, "--budget-s", "100", "--ids", str(first / "left.txt"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert read_outcomes(second) == {
        "test_synthetic.py::test_fails": "failed",
        "test_synthetic.py::test_skipped": "skipped",
        "test_synthetic.py::test_setup_error": "error",
        "test_synthetic.py::test_last[1]": "passed",
        "test_synthetic.py::test_last[2]": "passed",
    }
    assert (second / "left.txt").read_text() == ""
    assert "FAILED test_synthetic.py::test_fails" in r.stdout and "ERROR test_synthetic.py::test_setup_error" in r.stdout
    assert "0 of 5 left" in r.stdout


def test_a_finished_clean_selection_exits_zero_and_unknown_ids_are_reported(tmp_path):
    (tmp_path / "test_synthetic.py").write_text(SUITE)
    ids = tmp_path / "ids.txt"
    ids.write_text("test_synthetic.py::test_first\ntest_synthetic.py::test_last[2]\ntest_synthetic.py::test_gone\n")
    r = run_tool(tmp_path, tmp_path / "out", "--ids", str(ids))
    assert r.returncode == 0, r.stdout + r.stderr
    assert read_outcomes(tmp_path / "out") == {"test_synthetic.py::test_first": "passed",
                                               "test_synthetic.py::test_last[2]": "passed"}  # fmt: skip
    assert "2 passed; 0 of 2 left (left.txt); 1 listed ids not found" in r.stdout
