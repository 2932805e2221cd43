"""bench/ab_moe.py's CPU-side parts: exporting a revision's package, and the environment that makes
each side's process import its own package (the revision's first on the path)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ab_moe  # noqa: E402


def test_export_revision_from_git_and_from_a_directory(tmp_path):
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    out = ab_moe.export_revision("HEAD")
    assert os.path.isfile(os.path.join(out, "cute_moe", "__init__.py")) and out != ROOT
    (tmp_path / "cute_moe").mkdir()
    assert ab_moe.export_revision(str(tmp_path)) == str(tmp_path)


def test_each_side_imports_its_own_package(tmp_path, monkeypatch):
    """The revision's directory precedes the repository root; the tree's side has the root first.
    Checked by the import a child process makes, as the A/B's processes do."""
    (tmp_path / "cute_moe").mkdir()
    (tmp_path / "cute_moe" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    code = "import os, cute_moe; print(os.path.dirname(os.path.dirname(os.path.abspath(cute_moe.__file__))))"
    for package_dir, want in ((str(tmp_path), str(tmp_path)), (None, ROOT)):
        env = ab_moe.side_env(package_dir)
        assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/elsewhere"
        got = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path.parent), check=True,
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert got == want


def test_worker_argv_passes_the_selection_on():
    args = SimpleNamespace(reps=30, ep="2,4", only="DeepSeek", tokens="4096,8192")
    argv = ab_moe.worker_argv("/tmp/x.json", args)
    assert argv[1] == os.path.join(ROOT, "bench", "ab_moe.py") and "--worker" in argv
    assert argv[argv.index("--only") + 1] == "DeepSeek" and argv[argv.index("--tokens") + 1] == "4096,8192"
    assert argv[argv.index("--ep") + 1] == "2,4" and argv[argv.index("--json") + 1] == "/tmp/x.json"
