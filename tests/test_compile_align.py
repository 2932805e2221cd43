"""align's DSL kernel compiles for sm_90a and sm_100a with no GPU, and its SASS
has the shape the design relies on (see ``cute_moe/kernels/align.py``).

One fresh process per arch (the DSL fixes its default target at import), which
compiles every ``inspect_variants`` entry and reports, per kernel, the
instruction counts (``cute_moe.cubin.analyse_cubin``) and how many ``topk_ids``
loads are issued before the first ``ATOMS`` / ``MATCH`` of each pass.  Checked:

* global loads and stores, no local memory (spills), no calls;
* the histogram by shared-memory atomics (``ATOMS``, one per sub-chunk of 32
  entries), the ranks by ``MATCH.ANY`` + ``POPC`` (one per sub-chunk), ``SHFL``
  for the block scan; no global atomics;
* every load of a batch (``HIST_SUBCHUNKS`` / ``SUBCHUNKS`` of them per lane) in
  flight before the batch's first ``ATOMS`` / ``MATCH``, in both passes;
* the two-launch variant: its histogram step has the histogram pass only (one store
  of the chunk's counts per expert), its rank step the single launch's passes plus
  the ``MAX_CTAS`` predicated loads of every chunk's counts, all in flight together;
* at most 64 registers (the CTA is 1024 threads) and the shared-memory table
  within the 227 KB a Hopper or Blackwell CTA can opt into.

The host-side limits (``NotImplementedError`` beyond them) are checked here too:
they are raised before anything touches a GPU.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
MODULE = "cute_moe.kernels.align"

_REPORT = r"""
import importlib, json, re, sys
from cute_moe.cubin import analyse_cubin, disassemble

arch, module = sys.argv[1], sys.argv[2]
out = []
for variant, compiled, smem in importlib.import_module(module).inspect_variants(arch):
    cubin = compiled.artifacts.CUBIN
    reports = analyse_cubin(cubin, smem)
    assert len(reports) == 1, [r.name for r in reports]  # one kernel per variant
    batches, pending = [], 0  # loads issued before the first ATOMS / MATCH that follows them
    for line in disassemble(cubin).splitlines():
        pending += re.search(r"\bLDG\.E\b", line) is not None
        if pending and re.search(r"\b(MATCH\.ANY|ATOMS)\b", line):
            batches.append(pending)
            pending = 0
    out.append({"variant": variant, **reports[0].as_dict(), "load_batches": batches})
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=ARCHS)
def reports(request):
    env = {**os.environ, "CUTE_DSL_ARCH": request.param}
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, request.param, MODULE],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_variant_reported(reports):
    names = {r["variant"] for r in reports}
    assert len(names) == len(reports) >= 4
    assert any("E_local=1024" in n for n in names)  # the largest table the kernel accepts


def test_sass_memory_and_calls(reports):
    for r in reports:
        missing = [op for op in ("LDG", "STG") if not r["sass_counts"].get(op)]
        unwanted = [op for op in ("LDL", "STL", "CALL") if op in r["sass_counts"]]
        assert not missing and not unwanted and r["spill_bytes"] == 0, (r["variant"], missing, unwanted)
        assert 0 < r["registers"] <= 64, (r["variant"], r["registers"])  # 1024 threads per CTA
        assert 0 < r["smem_bytes"] <= 227 * 1024, (r["variant"], r["smem_bytes"])


def _is_histogram_step(r):
    return r["variant"].endswith("histogram]")


def test_sass_warp_collectives(reports):
    from cute_moe.kernels.align import HIST_SUBCHUNKS, SUBCHUNKS

    for r in reports:
        counts = r["sass_counts"]
        assert counts.get("ATOMS", 0) == HIST_SUBCHUNKS, (r["variant"], counts.get("ATOMS"))
        if _is_histogram_step(r):
            assert counts["STG"] == 1 and not any(op in counts for op in ("MATCH", "SHFL", "ATOMG", "RED"))
            continue
        assert counts.get("MATCH", 0) == SUBCHUNKS, (r["variant"], counts.get("MATCH"))
        assert counts.get("SHFL", 0) >= 10, r["variant"]  # two 5-step scans
        assert counts.get("POPC", 0) >= SUBCHUNKS, r["variant"]
        assert counts.get("BAR", 0) >= 4, r["variant"]
        assert "ATOMG" not in counts and "RED" not in counts, r["variant"]


def test_sass_loads_in_flight(reports):
    from cute_moe.kernels.align import HIST_SUBCHUNKS, MAX_CTAS, SUBCHUNKS

    for r in reports:
        # every load of a batch before the batch's first ATOMS / MATCH; the rank step's loads of the
        # chunks' counts come before the first rank batch
        if _is_histogram_step(r):
            want = [HIST_SUBCHUNKS]
        elif r["variant"].endswith("rank]"):
            want = [HIST_SUBCHUNKS, MAX_CTAS + SUBCHUNKS]
        else:
            want = [HIST_SUBCHUNKS, SUBCHUNKS]
        assert r["sass_counts"]["LDG"] == sum(want), r["variant"]
        assert r["load_batches"] == want, (r["variant"], r["load_batches"])


def test_limits_raise_before_any_launch():
    from cute_moe.kernels.align import MAX_CTAS, MAX_ENTRIES, MAX_LOCAL_EXPERTS, align_cuda

    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="num_local_experts"):
        align_cuda(ids, MAX_LOCAL_EXPERTS + 1)
    with pytest.raises(NotImplementedError, match="T \\* k"):
        align_cuda(torch.zeros(MAX_ENTRIES // 8 + 1, 8, dtype=torch.int32), 256)
    with pytest.raises(NotImplementedError, match="int32"):
        align_cuda(ids.long(), 8)
    for ctas in (0, MAX_CTAS + 1):
        with pytest.raises(ValueError, match="ctas"):
            align_cuda(ids, 8, ctas=ctas)


def test_cta_count_rule():
    """One CTA below MIN_CTAS chunks of ENTRIES_PER_CTA entries, then one CTA per chunk up to MAX_CTAS."""
    from cute_moe.kernels.align import ENTRIES_PER_CTA, MAX_CTAS, MIN_CTAS, align_ctas

    assert [align_ctas(n) for n in (1, 8, MIN_CTAS * ENTRIES_PER_CTA - 1)] == [1, 1, 1]
    assert align_ctas(MIN_CTAS * ENTRIES_PER_CTA) == MIN_CTAS
    assert align_ctas(16384 * 8) == MAX_CTAS == align_ctas(1 << 22)


def test_t0_needs_no_launch():
    from cute_moe.kernels.align import align_cuda
    from cute_moe.reference import align_ref

    ids = torch.zeros(0, 8, dtype=torch.int32)
    for got, want in zip(align_cuda(ids, 256, 128, 32, 64), align_ref(ids, 256, 128, 32, 64)):
        assert got.dtype == want.dtype and torch.equal(got, want)
