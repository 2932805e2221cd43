"""bench/ab_grouped_gemm.py's CPU-side parts: the variant syntax, and loading the sm90 kernel as it
was at a git revision beside this tree's (the A/B of a kernel change against its parent)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
ab = pytest.importorskip("ab_grouped_gemm")


def test_parse_variant():
    assert ab.parse_variant("along_m=1,block_scaled=0") == {"along_m": True, "block_scaled": False}
    assert ab.parse_variant("stages=5") == {"stages": 5}
    for bad in ("along_m", "=1", "a b=1"):
        with pytest.raises(Exception, match="KEY=VAL"):
            ab.parse_variant(bad)


def test_load_revision_imports_the_kernel_beside_this_one():
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    pytest.importorskip("cutlass")
    from cute_moe.kernels import grouped_gemm_sm90

    rev = ab.load_revision("HEAD")
    assert rev.__name__ == "cute_moe.kernels._ab_rev_sm90" and rev is not grouped_gemm_sm90
    assert rev.grouped_gemm_fp8_cuda is not grouped_gemm_sm90.grouped_gemm_fp8_cuda
    assert os.path.isfile(rev.__file__)  # kept for the DSL, which reads the source when it compiles


def test_load_revision_from_a_directory(tmp_path):
    """The device machine's copy of the tree has no git history: the files come exported."""
    pytest.importorskip("cutlass")
    for name in ("grouped_gemm_sm90.py", "grouped_gemm_schedule.py"):
        (tmp_path / name).write_text(open(os.path.join(ROOT, "cute_moe", "kernels", name)).read())
    rev = ab.load_revision(str(tmp_path))
    assert callable(rev.grouped_gemm_fp8_cuda) and rev.__name__ == "cute_moe.kernels._ab_rev_sm90"


def test_defined_rows_leave_out_padding_only_with_counts():
    """The rows whose bits the A/B compares: all rows below expert_offsets[-1] without expert
    counts; with them, each segment's first counts[e] rows (its padding rows are unspecified)."""
    from types import SimpleNamespace

    import torch

    offsets = torch.tensor([0, 128, 128, 384], dtype=torch.int32)
    counts = [3, 0, 130]
    plain = SimpleNamespace(offsets=offsets, counts=counts, expert_counts=None, end=384)
    assert ab.defined_rows(plain).tolist() == list(range(384))
    with_counts = SimpleNamespace(offsets=offsets, counts=counts, expert_counts=torch.tensor(counts), end=384)
    assert ab.defined_rows(with_counts).tolist() == [0, 1, 2] + list(range(128, 258))
