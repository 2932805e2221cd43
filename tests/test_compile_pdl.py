"""Every kernel of the MoE layer (and the standalone quantizers) is built for programmatic
dependent launch: its SASS waits for the previous grid (``griddepcontrol.wait`` -> ACQBULK)
before touching memory and releases the next one (``launch_dependents`` -> PREEXIT)."""
import json

import pytest

from .test_kernel_compile import _inspect

PDL_OPS = ("route", "align", "permute_quant", "silu_mul_quant", "grouped_gemm_fp8", "finalize", "quant_fp8",
           "moe_reduce", "fill_kv_cache_fp8")  # fmt: skip


@pytest.mark.parametrize("op", PDL_OPS)
def test_kernels_wait_for_the_previous_grid(op):
    proc = _inspect(op, "sm_90a", "--json")
    assert proc.returncode == 0, proc.stderr
    for kernel in json.loads(proc.stdout)["kernels"]:
        counts = kernel["sass_counts"]
        assert counts.get("ACQBULK", 0) >= 1, f"{kernel['name']}: no griddepcontrol.wait"
        assert counts.get("PREEXIT", 0) >= 1, f"{kernel['name']}: no griddepcontrol.launch_dependents"
