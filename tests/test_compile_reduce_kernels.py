"""finalize's and moe_reduce's DSL kernels compile for sm_90a and sm_100a with no GPU,
and their SASS has the shape the design relies on.

One fresh process per arch (the DSL fixes its default target at import), which
compiles every ``inspect_variants`` entry of both modules and reports, per
kernel, the instruction counts (``cute_moe.cubin.analyse_cubin``) and how many
16-byte row loads are issued before the first multiply.  Checked:

* global loads and stores, no local memory (spills), no calls, no atomics (each output element
  is written once by one thread: deterministic, as the op promises);
* no FFMA: products and sums are separately rounded (``mul.rn`` / ``add.rn``),
  which is what makes the outputs bit-identical to the references;
* every row load of a batch (``min(k, 8) * V`` 128-bit loads) is in flight before
  the math starts, and each thread stores ``V`` 128-bit vectors;
* fp32_acc=False on 16-bit rows rounds every product and partial sum (conversions
  present).
"""
import json
import os
import re
import subprocess
import sys

import pytest

ARCHS = ("sm_90a", "sm_100a")
MODULES = ("cute_moe.kernels.finalize", "cute_moe.kernels.moe_reduce")

_REPORT = r"""
import importlib, json, re, sys
from cute_moe.cubin import analyse_cubin, disassemble

arch = sys.argv[1]
out = []
for module in sys.argv[2:]:
    for variant, compiled, smem in importlib.import_module(module).inspect_variants(arch):
        cubin = compiled.artifacts.CUBIN
        reports = analyse_cubin(cubin, smem)
        assert len(reports) == 1, [r.name for r in reports]  # one kernel per variant
        for report in reports:
            before_math, row_loads, wide_stores = 0, 0, 0
            seen_math = False
            for line in disassemble(cubin).splitlines():
                if re.search(r"\bLDG\.E\.128\b", line):
                    row_loads += 1
                    before_math += not seen_math
                seen_math = seen_math or re.search(r"\bFMUL\b", line) is not None
                wide_stores += re.search(r"\bSTG\.E\.128\b", line) is not None
            out.append({"module": module, "variant": variant, **report.as_dict(),
                        "row_loads": row_loads, "row_loads_before_math": before_math,
                        "wide_stores": wide_stores})
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=ARCHS)
def reports(request):
    env = {**os.environ, "CUTE_DSL_ARCH": request.param}
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, request.param, *MODULES],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shape(variant: str):
    """(k, V, elements per 16 bytes, low-precision accumulation) from a variant's name."""
    from cute_moe.kernels.reduce_common import vectors_per_thread

    k = int(re.search(r"k=(\d+)", variant).group(1))
    elems = 4 if "float32" in variant else 8
    lowp = "fp32_acc=False" in variant and elems == 8
    return k, vectors_per_thread(k), elems, lowp


def test_every_variant_reported(reports):
    names = {r["variant"] for r in reports}
    assert sum(n.startswith("finalize[") for n in names) >= 3
    assert sum(n.startswith("moe_reduce[") for n in names) >= 3
    assert len(reports) == len(names)


def test_sass_memory_and_calls(reports):
    for r in reports:
        counts = r["sass_counts"]
        assert counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0, r["variant"]
        assert "LDL" not in counts and "STL" not in counts and r["spill_bytes"] == 0, r["variant"]
        assert "CALL" not in counts, r["variant"]
        assert not {"ATOM", "ATOMG", "RED", "REDG", "ATOMS"} & set(counts), r["variant"]
        assert r["smem_bytes"] == 0, r["variant"]
        assert 0 < r["registers"] <= 128, (r["variant"], r["registers"])


def test_sass_separately_rounded_math(reports):
    for r in reports:
        counts = r["sass_counts"]
        k, vecs, elems, _ = _shape(r["variant"])
        assert "FFMA" not in counts, f"{r['variant']}: a product was contracted into an FMA"
        assert counts.get("FMUL", 0) >= k * vecs * elems, r["variant"]
        assert counts.get("FADD", 0) >= k * vecs * elems, r["variant"]


def test_sass_loads_in_flight_before_math(reports):
    for r in reports:
        k, vecs, _, _ = _shape(r["variant"])
        assert r["row_loads"] == k * vecs, (r["variant"], r["row_loads"])
        assert r["row_loads_before_math"] >= min(k, 8) * vecs, (r["variant"], r["row_loads_before_math"])
        assert r["wide_stores"] == vecs, (r["variant"], r["wide_stores"])


def test_sass_low_precision_accumulation_rounds(reports):
    for r in reports:
        k, vecs, elems, lowp = _shape(r["variant"])
        conversions = r["sass_counts"].get("F2F", 0) + r["sass_counts"].get("F2FP", 0)
        if lowp:  # every product and partial sum rounded to the row dtype (F2FP packs two)
            assert conversions >= k * vecs * elems, (r["variant"], conversions)
        else:  # one conversion of the result (F2FP packs two), none per step
            assert conversions <= vecs * elems, (r["variant"], conversions)


def test_validation_knows_the_kernels_top_k_limit():
    """fused_moe_routed refuses k > 32 on the GPU up front (validation cannot import the DSL)."""
    from cute_moe import validation
    from cute_moe.kernels.reduce_common import MAX_K

    assert validation._GPU_MAX_TOPK == MAX_K
