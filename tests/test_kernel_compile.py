"""Every DSL kernel compiles for sm_90a and sm_100a with no GPU, and its SASS
holds the instructions it must (checked through the inspect CLI, in a fresh
process per arch because the DSL fixes its default target at import)."""
import json
import os
import subprocess
import sys

import pytest

from cute_moe.kernels import KERNEL_MODULES

ARCHS = ("sm_90a", "sm_100a")


def _inspect(op: str, arch: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    return subprocess.run(
        [sys.executable, "-m", "cute_moe.inspect", op, "--arch", arch, *flags],
        capture_output=True, text=True, env=env, timeout=600,
    )


@pytest.fixture(scope="module", params=ARCHS)
def quant_fp8_report(request):
    proc = _inspect("quant_fp8", request.param, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_quant_fp8_sass(quant_fp8_report):
    report = quant_fp8_report
    assert report["op"] == "quant_fp8" and report["arch"] in ARCHS
    assert len(report["kernels"]) == 3
    for k in report["kernels"]:
        counts = k["sass_counts"]
        assert set(k) >= {"name", "registers", "smem_bytes", "spill_bytes", "sass_counts"}
        assert counts.get("F2FP", 0) > 0, "no hardware FP8 conversion"
        assert counts.get("SHFL", 0) > 0, "amax is not a warp-shuffle reduction"
        assert counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0
        assert "CALL" not in counts, "a division slow path crept in"
        assert "LDL" not in counts and "STL" not in counts and k["spill_bytes"] == 0
        assert 0 < k["registers"] <= 64 and k["smem_bytes"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_fill_kv_cache_fp8_sass(arch):
    proc = _inspect("fill_kv_cache_fp8", arch, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert len(report["kernels"]) == 6  # 4 prefill variants, 2 small-batch (decode) ones
    for k in report["kernels"]:
        counts = k["sass_counts"]
        assert counts.get("F2FP", 0) > 0 and counts.get("SHFL", 0) > 0
        assert counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0
        assert "CALL" not in counts, "a division slow path crept in"
        assert "LDL" not in counts and "STL" not in counts and k["spill_bytes"] == 0
        assert 0 < k["registers"] <= 96 and k["smem_bytes"] == 0


def test_inspect_text_output():
    proc = _inspect("quant_fp8", "sm_90a")
    assert proc.returncode == 0, proc.stderr
    assert "registers" in proc.stdout and "F2FP" in proc.stdout


def test_inspect_refuses_ops_without_kernels():
    no_kernel = "fused_moe"  # a composition of the other ops, not a kernel
    assert no_kernel not in KERNEL_MODULES
    proc = _inspect(no_kernel, "sm_90a")
    assert proc.returncode == 2 and "no CuTe DSL kernel yet" in proc.stderr
    proc = _inspect("not_an_op", "sm_90a")
    assert proc.returncode == 2 and "unknown op" in proc.stderr


def test_import_is_cheap_and_gpu_free():
    code = (
        "import sys, torch, cute_moe\n"
        "assert 'cutlass' not in sys.modules, 'importing cute_moe imported the DSL'\n"
        "assert not torch.cuda.is_initialized(), 'importing cute_moe initialised CUDA'\n"
        "assert hasattr(torch.ops.cute_moe, 'fused_moe')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arch,mma", [("sm_90a", "QGMMA"), ("sm_100a", "UTCQMMA")])
def test_grouped_gemm_sass(arch, mma):
    """The issues' CI check through the inspect CLI: FP8 tensor-core MMA (Hopper WGMMA, Blackwell
    tcgen05) and TMA present, no local memory, within 227 KB of shared memory."""
    proc = _inspect("grouped_gemm_fp8", arch, "--json")
    assert proc.returncode == 0, proc.stderr
    kernels = json.loads(proc.stdout)["kernels"]
    assert kernels
    for kernel in kernels:
        counts = kernel["sass_counts"]
        assert counts.get(mma, 0) >= 4, f"{mma} missing: the kernel is on a slow path"
        assert counts.get("UTMALDG", 0) >= 2 and counts.get("UTMASTG", 0) >= 1, "A, B in and C out by TMA"
        assert "LDL" not in counts and "STL" not in counts and kernel["spill_bytes"] == 0
        assert kernel["smem_bytes"] <= 227 * 1024


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_grouped_gemm_swiglu_inspect_lists_what_runs(arch):
    """sm_90a: the fused kernels (QGMMA; 256 wide the FP8 tile out by TMA, 128 wide the codes from
    registers after the pair's amax exchange by st.async); sm_100a, which has no fused kernel: the
    two kernels the op runs there, the GEMM (tcgen05) and silu_mul_quant."""
    proc = _inspect("grouped_gemm_fp8_swiglu", arch, "--json")
    assert proc.returncode == 0, proc.stderr
    kernels = json.loads(proc.stdout)["kernels"]
    gemms = [k for k in kernels if k["variant"].startswith("grouped_gemm_fp8")]
    assert gemms and all(k["spill_bytes"] == 0 for k in kernels)
    if arch == "sm_90a":
        assert len(gemms) == len(kernels) and all("(gate | up)" in k["variant"] for k in gemms)
        assert all(k["sass_counts"].get("QGMMA", 0) >= 4 for k in gemms)
        wide = [k for k in gemms if "128x256x128" in k["variant"]]
        narrow = [k for k in gemms if "128x128x128" in k["variant"]]
        assert len(wide) + len(narrow) == len(gemms) and wide and narrow
        assert all(k["sass_counts"].get("UTMASTG", 0) >= 1 for k in wide)
        assert all(k["sass_counts"].get("STAS", 0) >= 1 and "UTMASTG" not in k["sass_counts"] for k in narrow)
    else:
        assert all(k["sass_counts"].get("UTCQMMA", 0) >= 4 for k in gemms)
        assert any(k["variant"].startswith("silu_mul_quant") for k in kernels)


_CLI_CHECKED_ABOVE = {"quant_fp8", "fill_kv_cache_fp8", "grouped_gemm_fp8", "grouped_gemm_fp8_swiglu"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", sorted(set(KERNEL_MODULES) - _CLI_CHECKED_ABOVE))
def test_inspect_cli_compiles_every_op_without_spills(op, arch):
    """Issue 5's CPU check, through the command it names (``python -m cute_moe.inspect OP --arch``)
    for each op the tests above do not run it for: the op's kernels compile, none spills.  Their
    SASS shapes are checked by the tests/test_compile_*.py files."""
    proc = _inspect(op, arch, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["op"] == op and report["arch"] == arch and report["kernels"]
    for kernel in report["kernels"]:
        counts = kernel["sass_counts"]
        assert "LDL" not in counts and "STL" not in counts and kernel["spill_bytes"] == 0, kernel["variant"]
        assert counts.get("LDG", 0) + counts.get("UTMALDG", 0) + counts.get("LDGSTS", 0) > 0, kernel["variant"]
