"""The Blackwell grouped FP8 GEMM (``cute_moe/kernels/grouped_gemm_sm100.py``) compiles for
sm_100a with no GPU and its SASS has the shape the design relies on (its tile schedule is
checked in ``test_grouped_gemm_schedule.py``).

No Blackwell GPU is available: these checks and the schedule model are all the evidence
there is until ``tests/test_gpu_grouped_gemm_sm100.py`` runs on a B200/GB200.

The compile runs in a fresh process with ``CUTE_DSL_ARCH=sm_100a`` (the DSL fixes its
default target at import) through the module's ``inspect_variants``; the cubin is analysed
with ``cute_moe.cubin``.  Checked in the SASS:

* ``UTCQMMA`` (tcgen05 FP8 MMA), 4 per K block (128 = 4 x 32), and ``UTCBAR`` (commit):
  ``UTCBAR.MULTICAST`` releasing an A/B stage in both CTAs of the cluster, a plain one
  publishing the CTA's own TMEM buffer;
* ``UTMALDG`` for A (2D, ``.MULTICAST``: clusters of 2 CTAs along N share the A tile) and B
  (3D, per CTA), ``UTMASTG`` for C, ``LDGSTS`` (cp.async) for the scales, ``LDTM`` (TMEM
  loads) feeding 64 FFMA per thread per K block: the promotion runs on CUDA cores in f32;
* the cluster barrier (``UCGABAR_ARV`` / ``UCGABAR_WAIT``) that makes both CTAs' mbarrier
  inits visible before either multicasts into the other;
* no local memory (``LDL`` / ``STL``), no Hopper or legacy MMA;
* registers that fit 352 threads on one SM, shared memory within the 227 KB a CTA can
  opt into, and the kernel's TMEM allocation within the SM's 512 columns.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

gg = pytest.importorskip("cute_moe.kernels.grouped_gemm_sm100")


SMEM_LIMIT = 227 * 1024
TMEM_CAPACITY = 512  # 32-bit columns per SM (x 128 lanes)

_SCRIPT = r"""
import json, re
from cute_moe.cubin import analyse_cubin, disassemble
from cute_moe.kernels.grouped_gemm_sm100 import inspect_variants
op = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_x]+)*)")
out = []
for variant, compiled, smem in inspect_variants("sm_100a"):
    sass = disassemble(compiled.artifacts.CUBIN)
    opcodes = [m.group(1) for m in map(op.match, sass.splitlines()) if m]
    for report in analyse_cubin(compiled.artifacts.CUBIN, smem):
        out.append({"variant": variant, "expected_smem": smem, "opcodes": opcodes, **report.as_dict()})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kernel():
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = json.loads(proc.stdout.splitlines()[-1])
    return report


def _count(opcodes, name):
    return sum(o == name or o.startswith(name + ".") for o in opcodes)


def test_tcgen05_mma_and_tma(kernel):
    counts, ops = kernel["sass_counts"], kernel["opcodes"]
    assert counts.get("UTCQMMA", 0) == 4, "tcgen05 FP8 MMA (kind::f8f6f4) missing: 4 per 128-wide K block"
    assert counts.get("UTCBAR", 0) >= 2, "tcgen05.commit for the A/B stage and the TMEM buffer"
    assert _count(ops, "UTMALDG.2D") >= 1 and _count(ops, "UTMALDG.3D") >= 1, "A (2D) and B (3D) by TMA"
    assert counts.get("UTMASTG", 0) >= 1, "C by TMA store"
    assert not {"QGMMA", "HGMMA", "HMMA", "IMMA"} & set(counts), "a non-tcgen05 MMA path crept in"


def test_a_multicast_in_a_cluster(kernel):
    """Clusters of 2 CTAs along N: A by one multicast TMA load per CTA (its half, into both CTAs),
    B by a plain per-CTA load; each MMA warp releases a stage in both CTAs (multicast commit) and
    publishes its TMEM buffer locally; barrier inits are fenced by the cluster barrier."""
    assert gg.CLUSTER_N == 2
    ops = kernel["opcodes"]
    assert ops.count("UTMALDG.2D.MULTICAST") == 1 and _count(ops, "UTMALDG.2D") == 1, "A must be multicast"
    assert ops.count("UTMALDG.3D") == 1, "B is per CTA (the M tiles of a cluster would not share an expert)"
    assert ops.count("UTCBAR.MULTICAST") == 1, "the A/B stage release must reach both CTAs' empty barriers"
    assert ops.count("UTCBAR") == 1, "the TMEM buffer is published by a local commit"
    assert ops.count("UCGABAR_ARV") >= 1 and ops.count("UCGABAR_WAIT") >= 1, (
        "barrier inits must be visible cluster-wide before any multicast")  # fmt: skip


def test_scales_and_promotion(kernel):
    counts, ops = kernel["sass_counts"], kernel["opcodes"]
    assert _count(ops, "LDGSTS.E.LTC128B.128") >= 1, "the 128 A scales come in 16 bytes per lane by cp.async"
    assert counts.get("ARRIVES", 0) >= 1, "cp.async completion arrives on the scale pipeline's mbarrier"
    assert counts.get("LDTM", 0) >= 2, "each K block's product leaves TMEM by tcgen05.ld"
    # 64 columns per thread (two 32-column loads), promoted in f32 on CUDA cores.
    assert counts.get("FFMA", 0) + 2 * counts.get("FFMA2", 0) >= 64
    assert counts.get("F2FP", 0) >= 32, "bf16 conversion of 64 values per thread in the epilogue"


def test_no_spills_and_budgets(kernel):
    counts = kernel["sass_counts"]
    assert "LDL" not in counts and "STL" not in counts and kernel["spill_bytes"] == 0
    assert 0 < kernel["registers"] <= 65536 // gg.GroupedGemmFp8Sm100.num_threads
    # The DSL declares its dynamic shared memory `.align 1024`: ptxas reserves up to 1 KB of
    # static shared memory for that alignment, and nothing else.
    assert kernel["expected_smem"] <= kernel["smem_bytes"] <= kernel["expected_smem"] + 1024
    assert kernel["smem_bytes"] <= SMEM_LIMIT


def test_tmem_allocation():
    # tcgen05.alloc takes a power of two >= 32 columns; one CTA per SM holds all of them.
    cols = gg.TMEM_COLUMNS
    assert cols == gg.ACC_STAGES * gg.TILE_N
    assert 32 <= cols <= TMEM_CAPACITY and cols & (cols - 1) == 0


def test_launch_uses_the_cluster_schedule(monkeypatch):
    """The host launches through the shared schedule with cluster_n = CLUSTER_N (an even grid of
    tile-group visits, the sm_90a kernel's schedule)."""
    seen = {}

    def fake_launch(arch, compiled, cluster_n, *args, op):
        seen.update(arch=arch, cluster_n=cluster_n, nargs=len(args), op=op)
        return "c"

    monkeypatch.setattr(gg, "launch", fake_launch)
    assert gg.grouped_gemm_fp8_sm100_cuda(1, 2, 3, 4, 5) == "c"
    assert seen == {"arch": "sm_100a", "cluster_n": gg.CLUSTER_N, "nargs": 5, "op": "grouped_gemm_fp8"}
    assert gg.grouped_gemm_fp8_sm100_cuda(1, 2, 3, 4, 5, op="grouped_gemm_fp8_swiglu") == "c"
    assert seen["op"] == "grouped_gemm_fp8_swiglu"


def test_other_archs_have_no_variant():
    assert gg.inspect_variants("sm_90a") == []


# ----------------------------------------------------------------------------- host checks


def test_host_checks_run_before_any_gpu_work():
    a = torch.zeros(256, 256, dtype=torch.uint8)
    b = torch.zeros(2, 256, 256, dtype=torch.uint8)
    off = torch.tensor([0, 128, 256], dtype=torch.int32)
    b_scale = torch.ones(2, 2, 2)
    with pytest.raises(NotImplementedError, match="K must be"):
        gg.grouped_gemm_fp8_sm100_cuda(a[:, :200], torch.ones(2, 256).t(), b, b_scale, off)
    with pytest.raises(ValueError, match="MN-major"):
        gg.grouped_gemm_fp8_sm100_cuda(a, torch.ones(256, 2), b, b_scale, off)
    misaligned = torch.ones(2 * 256 + 1)[1:].view(2, 256).t()
    with pytest.raises(ValueError, match="16-byte"):
        gg.grouped_gemm_fp8_sm100_cuda(a, misaligned, b, b_scale, off)
