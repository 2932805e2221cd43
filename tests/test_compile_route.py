"""route's DSL kernel compiles for sm_90a and sm_100a with no GPU, and its SASS has the
shape the design relies on.

One fresh process per arch (the DSL fixes its default target at import) compiles every
``inspect_variants`` entry of ``cute_moe.kernels.route`` and reports, per kernel, the
instruction counts (``cute_moe.cubin.analyse_cubin``), the global loads issued before
the first math instruction, and the static lane layout of a few configurations.
Checked:

* warp shuffles (SHFL), the one-instruction warp max (REDUX; CREDUX on sm_100a) and ballots (VOTE) are
  there; global loads and stores; no local memory (spills), no calls, no shared memory;
* no FCHK: divisions are the inline fast-path sequence, never ``div.rn.f32`` with its
  slow-path subroutine;
* every logits (and bias) load is vectorised as planned and issued before any math;
* registers reported and moderate (a warp per token must keep many warps resident).
"""
import json
import os
import re
import subprocess
import sys

import pytest

ARCHS = ("sm_90a", "sm_100a")

_REPORT = r"""
import json, re, sys
from cute_moe.cubin import analyse_cubin, disassemble
from cute_moe.kernels import route

arch = sys.argv[1]
out = []
for variant, compiled, smem in route.inspect_variants(arch):
    cubin = compiled.artifacts.CUBIN
    reports = analyse_cubin(cubin, smem)
    assert len(reports) == 1, [r.name for r in reports]
    loads, before_math, widths = 0, 0, []
    seen_math = False
    for line in disassemble(cubin).splitlines():
        m = re.search(r"\bLDG\.E(\.[A-Z0-9]+)*", line)
        if m:
            loads += 1
            before_math += not seen_math
            widths.append(m.group(0))
        seen_math = seen_math or re.search(r"\b(MUFU|REDUX|FMNMX|SHFL)\b", line) is not None
    out.append({"variant": variant, **reports[0].as_dict(), "loads": loads,
                "loads_before_math": before_math, "load_widths": widths})
layouts = {}
for cfg in [("deepseek_v3", 256, 8, 8, 4), ("deepseek_v3", 384, 8, 1, 1), ("deepseek_v3", 512, 8, 64, 8),
            ("deepseek_v3", 8, 2, 4, 2), ("deepseek_v3", 384, 8, 16, 5), ("deepseek_v3", 8, 2, 8, 3),
            ("softmax", 8, 2, 1, 1), ("sigmoid_renorm", 512, 32, 1, 1), ("renormalize", 100, 4, 1, 1)]:
    method, E, k, ng, tg = cfg
    import torch
    reason = route.RouteKernel.can_implement(method, E, k, ng, tg, torch.float32, method == "deepseek_v3")
    kern = route.RouteKernel(method, E, k, ng, tg, route.torch_to_cutlass_dtype(torch.float32), False)
    layouts[repr(cfg)] = {"reason": reason, "V": kern.V, "vec": kern.vec, "grouped": kern.grouped,
                          "lanes_per_group": getattr(kern, "lanes_per_group", None),
                          "groups_per_lane": getattr(kern, "groups_per_lane", None)}
refusals = {
    "k33": route.RouteKernel.can_implement("softmax", 64, 33, 1, 1, torch.float32, False),
    "dsv3_k9": route.RouteKernel.can_implement("deepseek_v3", 256, 9, 8, 4, torch.float32, True),
    "E513": route.RouteKernel.can_implement("softmax", 513, 2, 1, 1, torch.float32, False),
    "f16": route.RouteKernel.can_implement("softmax", 64, 2, 1, 1, torch.float16, False),
    "bias_softmax": route.RouteKernel.can_implement("softmax", 64, 2, 1, 1, torch.float32, True),
}
print(json.dumps({"kernels": out, "layouts": layouts, "refusals": refusals}))
"""


@pytest.fixture(scope="module", params=ARCHS)
def report(request):
    env = {**os.environ, "CUTE_DSL_ARCH": request.param}
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT, request.param], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected_loads(variant: str):
    """(number of global loads, their SASS width suffix) for a variant's logits (+ bias)."""
    E = int(re.search(r"E=(\d+)", variant).group(1))
    f32 = "float32" in variant
    V = -(-E // 32)
    elem = 4 if f32 else 2
    vec = 16 // elem
    while V % vec or E % vec:
        vec //= 2
    n = V // vec
    width = {1: ".U16" if not f32 else "", 2: "" if not f32 else ".64", 4: ".64" if not f32 else ".128", 8: ".128"}[vec]
    if "bias" in variant:
        bvec = 4
        while V % bvec or E % bvec:
            bvec //= 2
        return n, width, V // bvec
    return n, width, 0


def _redux(counts: dict) -> int:
    """Warp reductions: REDUX on sm_90a, CREDUX (result in a uniform register) on sm_100a."""
    return counts.get("REDUX", 0) + counts.get("CREDUX", 0)


def test_every_variant_reported(report):
    names = [r["variant"] for r in report["kernels"]]
    assert len(names) == len(set(names)) == 5
    for method in ("deepseek_v3", "renormalize", "softmax", "llama4", "sigmoid_renorm"):
        assert any(n.startswith(f"route[{method},") for n in names), method


def test_sass_shape(report):
    for r in report["kernels"]:
        counts, name = r["sass_counts"], r["variant"]
        assert counts.get("SHFL", 0) > 0 and counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0, name
        assert _redux(counts) > 0 and counts.get("VOTE", 0) > 0, name
        assert "LDL" not in counts and "STL" not in counts and r["spill_bytes"] == 0, name
        assert "CALL" not in counts and "FCHK" not in counts, name
        assert r["smem_bytes"] == 0, name
        assert 0 < r["registers"] <= 96, (name, r["registers"])


def test_sass_loads_vectorised_and_first(report):
    for r in report["kernels"]:
        name = r["variant"]
        n, width, n_bias = _expected_loads(name)
        assert r["loads"] == n + n_bias == r["loads_before_math"], (name, r["load_widths"])
        assert sum(w == "LDG.E" + width for w in r["load_widths"]) >= n, (name, r["load_widths"])
        if n_bias:
            assert sum(w == "LDG.E.128" for w in r["load_widths"]) >= n_bias, (name, r["load_widths"])


def test_sass_selection_rounds(report):
    # One warp max per selection round (k), plus one per kept group (deepseek_v3) and the
    # softmax max: every round is a single REDUX, never a shuffle butterfly.
    for r in report["kernels"]:
        name = r["variant"]
        k = int(re.search(r"k=(\d+)", name).group(1))
        groups = re.search(r"groups=(\d+)/(\d+)", name)
        extra = int(groups.group(2)) if groups else 0
        extra += "softmax" in name
        assert _redux(r["sass_counts"]) == k + extra, (name, r["sass_counts"])
        assert r["sass_counts"]["VOTE"] == k + (int(groups.group(2)) if groups else 0), name


def test_lane_layouts(report):
    lay = report["layouts"]
    dsv3 = lay[repr(("deepseek_v3", 256, 8, 8, 4))]
    assert dsv3 == {"reason": None, "V": 8, "vec": 4, "grouped": True, "lanes_per_group": 4, "groups_per_lane": 1}
    kimi = lay[repr(("deepseek_v3", 384, 8, 1, 1))]
    assert kimi["V"] == 12 and not kimi["grouped"]
    many = lay[repr(("deepseek_v3", 512, 8, 64, 8))]
    assert many["V"] == 16 and many["groups_per_lane"] == 2 and many["reason"] is None
    assert lay[repr(("deepseek_v3", 8, 2, 4, 2))]["lanes_per_group"] == 2
    assert lay[repr(("deepseek_v3", 384, 8, 16, 5))]["lanes_per_group"] == 2
    assert lay[repr(("deepseek_v3", 8, 2, 8, 3))]["lanes_per_group"] == 1
    assert lay[repr(("softmax", 8, 2, 1, 1))]["V"] == 1
    assert lay[repr(("sigmoid_renorm", 512, 32, 1, 1))] == {
        "reason": None, "V": 16, "vec": 4, "grouped": False, "lanes_per_group": None, "groups_per_lane": None,
    }  # fmt: skip
    assert lay[repr(("renormalize", 100, 4, 1, 1))]["vec"] == 4  # V = 4 divides neither badly


def test_refusals(report):
    assert all(report["refusals"].values()), report["refusals"]
