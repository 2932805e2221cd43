"""bench/gpu_suite.py on small synthetic suites (CPU): the budget stops pytest after a test, the
record says what ran and what is left, a second call over ``left.txt`` finishes the selection, and
failures, errors, collection errors and ids not found are reported, never dropped."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "bench", "gpu_suite.py")

PYTEST_INI = "[pytest]\nmarkers =\n    gpu: needs a GPU\n"

SUITE = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown fails")

def test_first():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_setup_error(broken):
    pass

def test_teardown_error(broken_teardown):
    pass

def test_fails_then_teardown_error(broken_teardown):
    assert 1 == 2

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert 1 == 2

def test_skips_inside():
    pytest.skip("decided at run time")

@pytest.mark.parametrize("n", [1, 2])
def test_last(n):
    pass
'''

SUITE_IDS = ["test_fails", "test_skipped", "test_setup_error", "test_teardown_error", "test_fails_then_teardown_error",
             "test_xfail", "test_skips_inside", "test_last[1]", "test_last[2]"]  # fmt: skip


def make_suite(tmp_path, **files):
    (tmp_path / "pytest.ini").write_text(PYTEST_INI)
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)


def run_tool(cwd, out, *args):
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run([sys.executable, TOOL, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def read_outcomes(out):
    return dict(line.split() for line in (out / "outcomes.txt").read_text().splitlines())


def test_budget_stops_after_a_test_and_the_rest_resumes(tmp_path):
    make_suite(tmp_path, test_synthetic=SUITE)
    first, second = tmp_path / "out1", tmp_path / "out2"
    # A spent budget: the first test runs, then pytest stops.
    r = run_tool(tmp_path, first, "--marker", "", "--budget-s", "0", "test_synthetic.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert read_outcomes(first) == {"test_synthetic.py::test_first": "passed"}
    assert (first / "left.txt").read_text().split() == [f"test_synthetic.py::{i}" for i in SUITE_IDS]
    assert "1 passed; 9 left (left.txt)" in r.stdout
    # The second call runs exactly what was left, and names each failure and error.
    r = run_tool(tmp_path, second, "--marker", "", "--budget-s", "100", "--ids", str(first / "left.txt"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert read_outcomes(second) == {
        "test_synthetic.py::test_fails": "failed",
        "test_synthetic.py::test_skipped": "skipped",
        "test_synthetic.py::test_setup_error": "error",
        "test_synthetic.py::test_teardown_error": "error",
        "test_synthetic.py::test_fails_then_teardown_error": "failed",
        "test_synthetic.py::test_xfail": "xfailed",
        "test_synthetic.py::test_skips_inside": "skipped",
        "test_synthetic.py::test_last[1]": "passed",
        "test_synthetic.py::test_last[2]": "passed",
    }
    assert (second / "left.txt").read_text() == ""
    for line in ("FAILED test_synthetic.py::test_fails", "ERROR test_synthetic.py::test_setup_error",
                 "ERROR test_synthetic.py::test_teardown_error",
                 "FAILED test_synthetic.py::test_fails_then_teardown_error", "0 left (left.txt)"):  # fmt: skip
        assert line in r.stdout, (line, r.stdout)


def test_the_default_marker_selects_gpu_tests_only(tmp_path):
    """With ``-m gpu`` (the default) the unmarked test is deselected, not left for a next call."""
    make_suite(tmp_path, test_mixed="import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\n"
                                    "def test_on_cpu():\n    pass\n")  # fmt: skip
    r = run_tool(tmp_path, tmp_path / "out", "test_mixed.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert read_outcomes(tmp_path / "out") == {"test_mixed.py::test_on_gpu": "passed"}
    assert (tmp_path / "out" / "left.txt").read_text() == ""


def test_collection_errors_and_unknown_ids_are_failures_and_stay_left(tmp_path):
    broken = "import a_module_that_does_not_exist\n\ndef test_x():\n    pass\n"
    make_suite(tmp_path, test_synthetic=SUITE, test_broken=broken)
    r = run_tool(tmp_path, tmp_path / "out1", "--marker", "", "test_synthetic.py", "test_broken.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "COLLECTION ERROR test_broken.py" in r.stdout
    # Listed ids in a file that fails to collect, in a missing file, or gone from a file that exists
    # are reported and kept in left.txt; the others run.
    ids = tmp_path / "ids.txt"
    ids.write_text("test_synthetic.py::test_first\ntest_broken.py::test_x\ntest_missing.py::test_y\n"
                   "test_synthetic.py::test_gone\ntest_synthetic.py::test_last[2]\n")  # fmt: skip
    r = run_tool(tmp_path, tmp_path / "out2", "--marker", "", "--ids", str(ids))
    assert r.returncode == 1, r.stdout + r.stderr
    assert read_outcomes(tmp_path / "out2") == {"test_synthetic.py::test_first": "passed",
                                                "test_synthetic.py::test_last[2]": "passed"}  # fmt: skip
    assert (tmp_path / "out2" / "left.txt").read_text().split() == [
        "test_broken.py::test_x", "test_missing.py::test_y", "test_synthetic.py::test_gone"]
    assert "3 left (left.txt), of which 3 listed ids not found" in r.stdout
    # An empty list runs nothing and collects nothing.
    ids.write_text("")
    r = run_tool(tmp_path, tmp_path / "out3", "--ids", str(ids))
    assert r.returncode == 0 and "nothing ran; 0 left" in r.stdout, r.stdout + r.stderr
