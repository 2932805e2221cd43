"""The Hopper grouped FP8 GEMM (``cute_moe/kernels/grouped_gemm_sm90.py``) compiles for sm_90a with
no GPU, and these properties of its binary hold (the first two once failed only on the GPU):

* the register split between the producer warp group and the two math warp groups fits the CTA's
  launch allocation (``setmaxnreg`` moves registers within it: a split that asks for more, such as
  32 / 240 with 168 registers at launch, made the kernel hang on the H200);
* the K loop of the expert-counts variants is the plain variants' (at either tile width): its
  per-warp-group ``busy`` flag
  must be warp-uniform to the compiler, or the loop sits in a possibly divergent branch, with
  convergence barriers (``BSSY`` / ``BSYNC``) and the WGMMA descriptors built in vector registers
  (twice the ``R2UR``); measured up to 4% slower on the H200;
* in every variant the WGMMA descriptors stay on the uniform datapath: built from a thread's own
  MMA slice they were moved by two ``R2UR`` per WGMMA (16 in a K-block pair's loop, now at most
  one), 2.2-2.6% slower on the contiguous shapes (bench/NOTES.md, session 16).
* the expert-counts variants store a tile of at most 64 real rows from registers, two bf16 per
  4-byte store (``STG.E``, a 2-byte ``STG.E.U16`` would double the store instructions); the plain
  variants store through shared memory and TMA only;
* the 128-wide SwiGLU variant exchanges row amaxes within the cluster pair by ``st.async`` and
  stores its codes from registers, two per 2-byte store.

The innermost loop holding 8 ``QGMMA`` (a K-block pair of the 128-wide tile, one K block's two
halves of the 256-wide one) is found from the SASS branches (a branch to an earlier label closes a
loop).
"""
import json
import os
import re
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json
from cute_moe.cubin import analyse_cubin, disassemble
from cute_moe.kernels import grouped_gemm_sm90 as gg
out = {"regs": [gg._PRODUCER_REGS, gg._CONSUMER_REGS], "threads": gg.GroupedGemmFp8Sm90.num_threads, "variants": []}
for name, compiled, smem in gg.inspect_variants("sm_90a") + gg.inspect_swiglu_variants("sm_90a"):
    (report,) = analyse_cubin(compiled.artifacts.CUBIN, smem)
    out["variants"].append({"name": name, "registers": report.registers, "sass": disassemble(compiled.artifacts.CUBIN)})
print(json.dumps(out))
"""

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _k_loops(sass: str) -> list[list[str]]:
    """Opcodes of each K loop (label .. backward branch) holding 8 QGMMA: the K-block pair of the
    128-wide tile, a K block of the 256-wide one."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, m in ((i, _LABEL.match(line)) for i, line in enumerate(lines)) if m}
    loops = {}
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            ops = [o.group(1) for o in map(_OPCODE.match, lines[labels[m.group(1)] : i + 1]) if o]
            if ops.count("QGMMA") == 8:
                loops[(labels[m.group(1)], i)] = ops
    # Smallest first, each kept unless it overlaps one kept already: a branch back across a K loop's
    # end (the tile loop's tail, say) spans 8 QGMMA too but is not a K loop.
    kept = []
    for (a, b), ops in sorted(loops.items(), key=lambda item: len(item[1])):
        if all(b < c or d < a for (c, d), _ in kept):
            kept.append(((a, b), ops))
    assert kept, "no loop with 8 QGMMA"
    return [ops for _, ops in kept]


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_register_split_fits_the_launch_allocation(report):
    producer, consumer = report["regs"]
    assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer < consumer <= 256
    math_threads = report["threads"] - 128
    for v in report["variants"]:
        assert 128 * producer + math_threads * consumer <= report["threads"] * v["registers"], v["name"]


def test_expert_counts_k_loop_is_the_plain_one(report):
    """Every variant (clusters along N or M, with or without counts, 128 or 256 wide) runs the plain
    K loop: 8 QGMMA per loop trip (a pair of K blocks 128 wide, one K block's two halves 256 wide)
    and 64 FFMA of promotion per thread per 128 x 128 block of product."""
    assert {re.search(r"128x\d+x128", v["name"]).group(0) for v in report["variants"]} == {"128x128x128", "128x256x128"}
    assert any("expert_counts" in v["name"] for v in report["variants"]), "no expert-counts variant"
    for v in report["variants"]:
        loops = _k_loops(v["sass"])
        assert len(loops) == 1, (v["name"], len(loops))
        for ops in loops:
            assert ops.count("FFMA") == 2 * 64, "the promotion: 64 FFMA per thread per 128 x 128 block"
            assert not {"BSSY", "BSYNC"} & set(ops), "convergence barriers inside the K loop"
            assert ops.count("R2UR") <= 1, "WGMMA descriptors moved from vector registers"


def test_a_boxes_only_with_counts_along_n_and_long_k(report):
    """The TMA loads of each variant: A by one box, or by one of three box heights with expert
    counts, pairs along N and no store-behind epilogue (the w13 GEMM); B by one, or two with pairs
    along M (whole, or halves multicast)."""
    for v in report["variants"]:
        name = v["name"]
        boxed = "expert_counts" in name and "A shared" in name and "store-behind" not in name
        # the SwiGLU variants load B as two boxes (gate rows, up rows), each whole or multicast halves
        expected = (3 if boxed else 1) + (2 if "B shared" in name else 1) * (2 if "gate | up" in name else 1)
        assert len(re.findall(r"\bUTMALDG\b", v["sass"])) == expected, name


def test_sparse_epilogue_stores_bf16_pairs(report):
    stores = re.compile(r"\bSTG\.E(\.[A-Z0-9.]+)?\b")
    plain = [v for v in report["variants"] if "expert_counts" not in v["name"]]
    others = [v for v in report["variants"] if "expert_counts" in v["name"] and "gate | up" not in v["name"]]
    assert len(plain) == 5 and others
    for v in plain:
        assert not stores.search(v["sass"]), f"{v['name']}: the plain variant stores C by TMA only"
    for v in others:
        kinds = {m.group(0) for m in stores.finditer(v["sass"])}
        assert kinds == {"STG.E"}, (v["name"], kinds)


def test_pair_split_swiglu_exchanges_amax_and_stores_code_pairs(report):
    """The 128-wide SwiGLU variant: each row's amax goes to the pair's other CTA by ``st.async``
    (``STAS``, one per row of the thread), the codes leave from registers two per 2-byte store, and
    nothing goes through a TMA store."""
    (v,) = [v for v in report["variants"] if "gate | up" in v["name"] and "128x128x128" in v["name"]]
    ops = [m.group(1) for m in map(_OPCODE.match, v["sass"].splitlines()) if m]
    assert ops.count("STAS") == 2, ops.count("STAS")
    assert re.search(r"\bSTG\.E\.U16\b", v["sass"]) and "UTMASTG" not in ops, v["name"]


def test_launcher_refuses_a_variant_it_does_not_have_before_any_launch():
    """``tile_n`` other than 128 / 256: ValueError on the CPU, also where the launch would return
    early (no rows, no experts)."""
    import torch  # noqa: PLC0415

    gg = pytest.importorskip("cute_moe.kernels.grouped_gemm_sm90")
    for m_cap, experts in ((0, 2), (256, 0), (256, 2)):
        a = torch.zeros(m_cap, 256, dtype=torch.uint8)
        b = torch.zeros(experts, 256, 256, dtype=torch.uint8)
        off = torch.zeros(experts + 1, dtype=torch.int32)
        a_scale, b_scale = torch.ones(2, m_cap).t(), torch.ones(experts, 2, 2)
        for kw in ({"tile_n": 192}, {"tile_n": 256.0}):
            with pytest.raises(ValueError, match="tile_n"):
                gg.grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, off, **kw)
