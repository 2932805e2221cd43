"""The permute_quant / permute and silu_mul_quant kernels compile for sm_90a and
sm_100a with no GPU, and their SASS holds what it must.

Each (module, arch) compiles in a fresh process (the DSL fixes its default
target at import) through the module's ``inspect_variants``; the cubins are
analysed with ``cute_moe.cubin``.  Beyond the instruction mix (FP8 conversion,
global loads and stores, no local memory, no division slow-path CALL), the
checks pin the two properties the kernels are built around: every row load is
issued before the first instruction of math (the ``cp.async`` group precedes
the first shuffle; ``permute``'s loads precede its first store), and silu's
``expf`` is torch's libdevice sequence, once per element.
"""
import functools
import json
import os
import subprocess
import sys

import pytest

ARCHS = ("sm_90a", "sm_100a")
MODULES = ("cute_moe.kernels.permute_quant", "cute_moe.kernels.silu_mul_quant")
SILU_ROWS = 2  # silu_mul_quant: rows per thread, each 16 outputs (two 16-byte pieces of gate, two of up)
ELEMS_PER_THREAD = SILU_ROWS * 16
TOKEN_MAJOR = ((8, "none"), (8, "ue8m0"), (20, "none"))  # permute_quant's token-major variants (k, fmt)

_SCRIPT = r"""
import json, re, sys, importlib
from cute_moe.cubin import analyse_cubin, disassemble
module, arch = sys.argv[1], sys.argv[2]
op = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_x]+)*)")
out = []
for variant, compiled, smem in importlib.import_module(module).inspect_variants(arch):
    sass = disassemble(compiled.artifacts.CUBIN)
    opcodes = [m.group(1) for m in map(op.match, sass.splitlines()) if m]
    for report in analyse_cubin(compiled.artifacts.CUBIN, smem):
        out.append({"variant": variant, "expected_smem": smem, "opcodes": opcodes, **report.as_dict()})
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def _report(module: str, arch: str) -> list:
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, module, arch], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _first(opcodes, prefix, after=-1):
    return next(i for i, o in enumerate(opcodes) if i > after and o.startswith(prefix))


def _last(opcodes, prefix):
    return max(i for i, o in enumerate(opcodes) if o.startswith(prefix))


def _count(opcodes, name):
    return sum(o == name or o.startswith(name + ".") for o in opcodes)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", MODULES)
def test_common_sass(module, arch):
    kernels = _report(module, arch)
    assert kernels
    for k in kernels:
        counts = k["sass_counts"]
        assert counts.get("LDG", 0) > 0 and counts.get("STG", 0) > 0, k["variant"]
        assert "CALL" not in counts, f"{k['variant']}: a division slow path crept in"
        assert "LDL" not in counts and "STL" not in counts and k["spill_bytes"] == 0, k["variant"]
        # The DSL declares its dynamic shared memory `.align 1024`: ptxas reserves up to 1 KB of
        # static shared memory for that alignment, and nothing else.
        assert k["expected_smem"] <= k["smem_bytes"] <= k["expected_smem"] + 1024, "static shared memory appeared"


@pytest.mark.parametrize("arch", ARCHS)
def test_permute_quant_sass(arch):
    kernels = {k["variant"]: k for k in _report("cute_moe.kernels.permute_quant", arch)}
    assert list(kernels) == [
        "permute_quant[bfloat16, scale_fmt=none]",
        "permute_quant[bfloat16, scale_fmt=ue8m0]",
        *(f"permute_quant[bfloat16, token-major, k={k}, scale_fmt={f}]" for k, f in TOKEN_MAJOR),
        NO_ZEROING,
        TOKEN_SCALES,
        "permute_quant scale scatter",
        "permute_quant scale scatter, padding rows",
        "permute[float8_e4m3fn]",
    ]
    for fmt in ("none", "ue8m0"):
        k = kernels[f"permute_quant[bfloat16, scale_fmt={fmt}]"]
        counts, ops = k["sass_counts"], k["opcodes"]
        assert counts.get("F2FP", 0) > 0, "no hardware FP8 conversion"
        assert counts.get("SHFL", 0) > 0, "amax is not a warp-shuffle reduction"
        assert counts.get("LDGSTS", 0) == 4 and counts.get("BAR", 0) >= 1
        assert _last(ops, "LDGSTS") < _first(ops, "SHFL"), "row loads interleaved with math"
        assert 0 < k["registers"] <= 48 and k["expected_smem"] > 0
    permute = kernels["permute[float8_e4m3fn]"]
    ops = permute["opcodes"]
    assert "F2FP" not in permute["sass_counts"] and "LDGSTS" not in permute["sass_counts"]
    assert _count(ops, "LDG.E.128") == 4 and _last(ops, "LDG.E.128") < _first(ops, "STG")
    assert 0 < permute["registers"] <= 72


NO_ZEROING = "permute_quant[bfloat16, token-major, k=8, scale_fmt=none, padding rows not written]"
TOKEN_SCALES = NO_ZEROING[:-1] + ", token scales]"


@pytest.mark.parametrize("arch", ARCHS)
def test_permute_quant_token_major_without_zeroing_sass(arch):
    """zero_padding=False compiles the gathering CTAs alone: the same bulk copies, no zeroing
    stores, no ballot, no row_to_token load."""
    k = next(k for k in _report("cute_moe.kernels.permute_quant", arch) if k["variant"] == NO_ZEROING)
    counts, ops = k["sass_counts"], k["opcodes"]
    assert _count(ops, "LDG.E.128") == 1 and _count(ops, "UBLKCP") == 1
    assert ops.count("LDG.E") == 2, "expert_offsets[-1] and token_to_row only"
    assert ops.count("STG.E") == 1 and "STG.E.64" not in ops and "STG.E.128" not in ops
    assert "VOTE" not in counts


@pytest.mark.parametrize("arch", ARCHS)
def test_permute_quant_token_scales_sass(arch):
    """Scales in two launches: the gathering CTAs store one scale per token and group (one STG, by
    one lane, no per-destination stores); the scatter kernel loads each scale once and stores it
    once, no shared memory."""
    kernels = {k["variant"]: k for k in _report("cute_moe.kernels.permute_quant", arch)}
    ops = kernels[TOKEN_SCALES]["opcodes"]
    assert _count(ops, "UBLKCP") == 1 and ops.count("STG.E") == 1
    scatter = kernels["permute_quant scale scatter"]
    counts = scatter["sass_counts"]
    assert counts.get("LDG", 0) >= 1 and counts.get("STG", 0) >= 1 and "LDS" not in counts and "STS" not in counts
    assert 0 < scatter["registers"] <= 64


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("top_k", "fmt"), TOKEN_MAJOR)
def test_permute_quant_token_major_sass(arch, top_k, fmt):
    """One x load per token row and slab, all loads before the math; the codes go to shared memory
    and out by one bulk copy per token and destination (issued by the thread holding the entry);
    no code store from registers to global memory."""
    kernels = _report("cute_moe.kernels.permute_quant", arch)
    k = next(k for k in kernels if k["variant"] == f"permute_quant[bfloat16, token-major, k={top_k}, scale_fmt={fmt}]")
    counts, ops = k["sass_counts"], k["opcodes"]
    entries = -(-top_k // 16)  # token_to_row entries per lane
    assert counts.get("F2FP", 0) > 0, "no hardware FP8 conversion"
    assert "LDGSTS" not in counts and k["expected_smem"] == 2048
    assert _count(ops, "LDG.E.128") == 1, "x is not read once per token row"
    # Every load (x and token_to_row) is issued before the first instruction of math.
    assert _last(ops, "LDG.E.128") < _first(ops, "SHFL")
    assert ops.count("LDG.E") == 2 + entries, "expert_offsets[-1], row_to_token, token_to_row"
    # Quantizer: 4 butterfly steps per row; no index shuffles (each lane loads its own entries).
    assert _count(ops, "SHFL.BFLY") == 4 and "SHFL.IDX" not in ops
    # Codes: st.shared, proxy fence, barrier, one bulk copy per (token, lane-held entry), then the
    # wait for the copies' shared-memory reads; scales: one store per lane-held entry, plus the
    # zeroing CTAs' scale and their two 16-byte zero stores per padding row and lane.
    assert _count(ops, "STS") == 1 and "STG.E.64" not in ops
    assert _first(ops, "FENCE.VIEW.ASYNC.S") < _first(ops, "BAR.SYNC") < _first(ops, "UBLKCP")
    assert _count(ops, "UBLKCP") == entries and _last(ops, "UBLKCP") < _last(ops, "DEPBAR")
    assert ops.count("STG.E") == entries + 1
    assert _count(ops, "STG.E.128") == 2 and _count(ops, "VOTE") == 1
    # 32 registers or fewer: 8 CTAs of 256 threads per SM (k = 20 holds twice the entries).
    assert 0 < k["registers"] <= (32 if top_k <= 16 else 40)


@pytest.mark.parametrize("arch", ARCHS)
def test_silu_mul_quant_sass(arch):
    kernels = _report("cute_moe.kernels.silu_mul_quant", arch)
    assert [k["variant"] for k in kernels] == [
        "silu_mul_quant[bfloat16, scale_fmt=none]",
        "silu_mul_quant[bfloat16, scale_fmt=ue8m0]",
        "silu_mul_quant[bfloat16, scale_fmt=none, expert_counts]",
        "silu_mul_quant[bfloat16, scale_fmt=ue8m0, expert_counts]",
    ]
    for k, ue8m0 in zip(kernels, (False, True, False, True)):
        counts, ops = k["sass_counts"], k["opcodes"]
        assert counts.get("F2FP", 0) > 0 and counts.get("SHFL", 0) > 0
        assert counts.get("LDGSTS", 0) == 8, "gate and up: 2 rows x 2 pieces each, 16 bytes per cp.async"
        assert _last(ops, "LDGSTS") < _first(ops, "SHFL.BFLY", after=_first(ops, "LDGSTS")), (
            "row loads interleaved with math"
        )
        # torch's expf (libdevice): FFMA.SAT, FFMA.RM, MUFU.EX2 once per element; the division's
        # MUFU.RCP once per element, plus one per row for the quantizer's 1/scale (not in ue8m0).
        assert _count(ops, "FFMA.SAT") == ELEMS_PER_THREAD
        assert _count(ops, "FFMA.RM") == ELEMS_PER_THREAD
        assert _count(ops, "MUFU.EX2") == ELEMS_PER_THREAD
        assert _count(ops, "MUFU.RCP") == ELEMS_PER_THREAD + (0 if ue8m0 else SILU_ROWS)
        # FFMAs: 5 in expf and 4 in the division per element; per row 2 for amax / 448 and (not
        # ue8m0) 2 for the Newton step of 1/scale.  The quotient is y * (1/scale) (no residual
        # FMAs: correctly_rounded=False).
        assert _count(ops, "FFMA") == 9 * ELEMS_PER_THREAD + SILU_ROWS * (2 if ue8m0 else 4)
        # 8 lanes per (row, group): 3 butterfly steps per row; codes in two 8-byte stores per row.
        assert _count(ops, "SHFL.BFLY") == 3 * SILU_ROWS and "SHFL.IDX" not in ops
        assert ops.count("STG.E.64") == 2 * SILU_ROWS and ops.count("STG.E") == SILU_ROWS
        assert k["expected_smem"] == 32768 + 32, "input slots, then one word per warp"
        assert k["registers"] <= 40, "at most 40 registers: 6 CTAs of 256 threads per SM, as shared memory allows"
    for k in kernels[:2]:  # without counts: expert_offsets[-1] is the only plain load, no barrier
        assert k["opcodes"].count("LDG.E") == 1 and "BAR" not in k["sass_counts"]
    for k in kernels[2:]:
        # With counts, the CTA looks up its block's segment: thread t loads off[t], off[t + 1] and
        # counts[t] (one memory round trip for E <= 256), a warp max (REDUX on sm_90a, CREDUX on
        # sm_100a), one barrier, then the skip decision (made warp-uniform), and only then the
        # row loads.
        counts, ops = k["sass_counts"], k["opcodes"]
        assert ops.count("LDG.E") == 1 + 3
        redux = _first(ops, "REDUX" if arch == "sm_90a" else "CREDUX")
        assert _last(ops, "LDG.E") < redux < _first(ops, "BAR.SYNC") < _first(ops, "LDGSTS")
        assert counts.get("BAR", 0) == 1 and counts.get("STS", 0) == 1
        # The quantizer's shuffles sit under the skip branch: ptxas must see it as warp-uniform
        # (no WARPSYNC / collective fallback around every shuffle).
        assert "WARPSYNC" not in counts and "ENDCOLLECTIVE" not in counts
