"""``grouped_gemm_fp8_swiglu`` (the w13 GEMM with ``silu_mul_quant`` in its epilogue) on the GPU.

The fused kernel rounds its f32 accumulators to bf16, as the GEMM stores h, and runs
``silu_mul_quant``'s own silu and quantizer on them: its codes and scales must equal the two-kernel
path's (``grouped_gemm_fp8`` then ``silu_mul_quant``, the op's reference composition) bit for bit on
every real row, on the same inputs.  Outputs come from a poisoned allocator (a real row left
unwritten is NaN).  The cases are chosen so that the launch rule takes the fused kernel (asserted;
with expert counts the cluster direction too): pairs along M and along N (I / 128 odd too: a visit
past the last N tile, whose scales must not be written -- real rows cannot show such a write;
``bench/sanitize.sh memcheck`` runs two of these cases), gate first or second, f32 and ue8m0
scales, with and without expert counts, empty experts (the first, the last and about half of the
others).  The 128-wide kernel (decode sizes: 64 gate and 64 up
columns per tile, the cluster pair's CTAs exchanging row amaxes) is launched directly, with the
rule's choice asserted on its decode cases, and checked the same way on every row it defines, and
for NaN codes on a misaligned segment's tiles.  Also: no real row at all (M_cap = 0, and every
expert empty) at both widths, and a CUDA graph of the op captured once and replayed on new
routings and activations copied into its input buffers, at a decode size (the 128-wide kernel) and
a prefill size (the 256-wide one), each replay against the two kernels run afresh on the new inputs.
"""
from __future__ import annotations

import random

import pytest
import torch

from cute_moe.kernels import grouped_gemm_schedule as gs

from .moe_cases import poison_pools, zero_pools_for
from .test_gpu_grouped_gemm import (
    BLOCK,
    Routing,
    activations,
    deepgemm_counts,
    empty_counts,
    expert_weights,
    prefill_graph_routings,
    routing_from_counts,
    routing_from_topk,
)

pytest.importorskip("cute_moe.kernels.grouped_gemm_sm90")
pytestmark = pytest.mark.gpu

# (experts, rows per expert, I, K, clusters along M with expert counts): 2-6 real tiles per expert
# over >= 64 experts pair M tiles at K >= 4096; more tiles, or K < 4096, pair N tiles; I / 128 odd
# makes a visit past the last N tile.  (Contiguous segments pair along M from 1 to 6 tiles at any K.)
# "_empty": counts from ``empty_counts`` (the first, the last and about half of the other experts
# empty; the rule's estimate still reads 2.2-4.6 real tiles per expert for rows 1024, pairs along M,
# and 8-12.3 for rows 3072, pairs along N, for every seed of the test).
CASES = {
    "E64_rows384_I256_K4096_pairs_m": (64, 384, 256, 4096, True),
    "E64_rows1024_I256_K4096_pairs_n": (64, 1024, 256, 4096, False),
    "E64_rows1024_I384_K4096_pairs_n_odd": (64, 1024, 384, 4096, False),
    "E256_rows300_I2048_K7168_dsv3": (256, 300, 2048, 7168, True),
    # Qwen3-30B-A3B's w13 (K = 2048: the plain GEMM would store behind; the fused one keeps 4 stages)
    "E128_rows400_I768_K2048_qwen3": (128, 400, 768, 2048, False),
    "E64_rows1024_I256_K4096_pairs_m_empty": (64, 1024, 256, 4096, True),
    "E64_rows3072_I256_K4096_pairs_n_empty": (64, 3072, 256, 4096, False),
}


@pytest.fixture(autouse=True)
def _hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel is sm_90a's; elsewhere the op is the two-kernel path it is compared with")


@pytest.mark.parametrize("counted", [True, False], ids=["counts", "no_counts"])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_the_two_kernels(case, gate_first, scale_fmt, counted):
    E, rows, inter, K, pairs_m = CASES[case]
    seed = sum(map(ord, case)) * 31 + 2 * gate_first + (scale_fmt is not None) + 4 * counted
    counts = (empty_counts if case.endswith("_empty") else deepgemm_counts)(E, rows, random.Random(seed))
    routing = routing_from_counts(counts)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w13_scale = expert_weights(E, 2 * inter, K, g)
    a, a_scale = activations(routing, K, g)
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda") if counted else None
    along_m, _, tile_n = gs.sm90_launch_config(a.shape[0], E, K, counted)
    assert tile_n == gs.WIDE_TILE_N and (along_m == pairs_m or not counted), "the case must take this fused variant"
    op = torch.ops.cute_moe
    poison_pools(max(256 << 20, a.shape[0] * inter * 8))
    q, s = op.grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, routing.offsets, cnt, gate_first, scale_fmt)
    h = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, routing.offsets, cnt)
    q2, s2 = op.silu_mul_quant(h, routing.offsets, gate_first, scale_fmt, cnt)
    assert q.shape == q2.shape and s.shape == s2.shape and s.stride() == s2.stride()
    real = routing.real
    qr, sr, q2r, s2r = q[real], s[real], q2[real], s2[real]
    assert not sr.isnan().any() and not qr.float().isnan().any(), "unwritten or NaN real rows"
    # The GEMM's f32 accumulators are the same in both (same variant, same K order); the fused
    # epilogue rounds them to bf16 and runs silu_mul_quant's silu and quantizer: the same bits.
    assert torch.equal(sr, s2r), f"{(sr != s2r).sum().item()} scales differ"
    assert torch.equal(qr.view(torch.uint8), q2r.view(torch.uint8)), \
        f"{(qr.view(torch.uint8) != q2r.view(torch.uint8)).sum().item()} codes differ"


# The 128-wide variant (a tile holds 64 gate and 64 up columns, the pair's two tiles one 1x128 group,
# whose amax the two CTAs exchange): (experts, rows per expert, I, K).  Decode sizes (DeepSeek-V3's
# w13 on 8 experts; K = 2048 below half a real tile per expert, where the plain GEMM does not store
# behind), K = 2048 from half a real tile per expert (where the plain GEMM stores behind: the one
# kernel there under two estimated tiles per expert since session 31, two kernels before session
# 30), experts of several full tiles (every row of a tile live: the exchange of dense tiles),
# I / 128 odd (3 pairs of N tiles), empty experts (at I = 128 and at a decode size with I = 256).
SPLIT_CASES = {
    "E8_rows3_I2048_K7168_dsv3_decode": (8, 3, 2048, 7168),
    "E64_rows20_I256_K2048_decode": (64, 20, 256, 2048),
    "E16_rows200_I256_K2048_store_behind": (16, 200, 256, 2048),
    "E16_rows300_I384_K4096_dense": (16, 300, 384, 4096),
    "E32_rows90_I128_K1024_empty": (32, 90, 128, 1024),
    "E64_rows20_I256_K2048_decode_empty": (64, 20, 256, 2048),
}


@pytest.mark.parametrize("counted", [True, False], ids=["counts", "no_counts"])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_pair_split_equals_the_two_kernels(case, gate_first, scale_fmt, counted):
    """The 128-wide kernel's codes and scales equal the two kernels' bit for bit on every real row,
    every row of an expert-count-free launch included.  With expert counts the rule takes it in
    every case, and the op (no width forced) gives the same bits."""
    from cute_moe.kernels import grouped_gemm_sm90 as g90

    E, rows, inter, K = SPLIT_CASES[case]
    seed = sum(map(ord, case)) * 17 + 2 * gate_first + (scale_fmt is not None) + 4 * counted
    rng = random.Random(seed)
    counts = (empty_counts if case.endswith("_empty") else deepgemm_counts)(E, rows, rng)
    routing = routing_from_counts(counts)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w13_scale = expert_weights(E, 2 * inter, K, g)
    a, a_scale = activations(routing, K, g)
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda") if counted else None
    if counted:
        assert gs.sm90_swiglu_tile(a.shape[0], E, K, True) == gs.TILE_N, "the rule must take the 128-wide kernel"
    if case.endswith("_store_behind"):
        assert gs.sm90_launch_config(a.shape[0], E, K, counted)[1], "the plain GEMM must store behind here"
    op = torch.ops.cute_moe
    poison_pools(max(256 << 20, a.shape[0] * inter * 8))
    q, s = g90.grouped_gemm_fp8_swiglu_cuda(a, a_scale, w13, w13_scale, routing.offsets, cnt, gate_first, scale_fmt,
                                            tile_n=gs.TILE_N)  # fmt: skip
    h = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, routing.offsets, cnt)
    q2, s2 = op.silu_mul_quant(h, routing.offsets, gate_first, scale_fmt, cnt)
    assert q.shape == q2.shape and s.shape == s2.shape and s.stride() == s2.stride()
    live = routing.real if counted else torch.arange(a.shape[0], device="cuda") < routing.end
    qr, sr, q2r, s2r = q[live], s[live], q2[live], s2[live]
    assert not sr.isnan().any() and not qr.float().isnan().any(), "unwritten or NaN rows"
    assert torch.equal(sr, s2r), f"{(sr != s2r).sum().item()} scales differ"
    assert torch.equal(qr.view(torch.uint8), q2r.view(torch.uint8)), \
        f"{(qr.view(torch.uint8) != q2r.view(torch.uint8)).sum().item()} codes differ"
    if counted:
        q3, s3 = op.grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, routing.offsets, cnt, gate_first, scale_fmt)
        assert torch.equal(s3[live], sr) and torch.equal(q3[live].view(torch.uint8), qr.view(torch.uint8))


def test_pair_split_misaligned_segments_give_nan_codes():
    """With expert counts, a misaligned segment's tiles are written whole as NaN codes (the pair's
    exchanged amax of NaN rows included), never left as what the allocator held."""
    from cute_moe.kernels import grouped_gemm_sm90 as g90

    routing = routing_from_counts([128, 72, 184])
    g = torch.Generator(device="cuda").manual_seed(35)
    w13, w13_scale = expert_weights(3, 256, 1024, g)
    a, a_scale = activations(routing, 1024, g)
    routing.offsets.copy_(torch.tensor([0, 128, 200, 384], dtype=torch.int32))
    counts = torch.tensor([128, 40, 100], dtype=torch.int32, device="cuda")
    zero_pools_for(a.shape[0] * 128)  # zeros, not NaN: an unwritten row would pass as a plausible answer
    q, _ = g90.grouped_gemm_fp8_swiglu_cuda(a, a_scale, w13, w13_scale, routing.offsets, counts, tile_n=gs.TILE_N)
    assert bool(q[128:384].float().isnan().all()), "a misaligned segment's tiles must be NaN"
    assert not q[:128].float().isnan().any()


def test_expected_m_changes_the_launch_not_the_result():
    """An expert-parallel slice (32 local experts of 256, M_cap sized for every routed row, as align
    sizes it): M_cap's estimate reads 8x the real rows, and under 64 experts the rule takes the
    128-wide tile (the pair-split kernel); with fused_moe's ``expected_m`` (T * k // 256) the wide tile,
    paired along M at K = 4096, and the fused kernel.  Both ops' real rows are the same bits either
    way (the GEMM's K order is the same in every variant)."""
    E, rows, inter, K, T = 32, 256, 256, 4096, 8192
    counts = deepgemm_counts(E, rows, random.Random(11))
    m_cap = -(-(T * 8 + E * 127) // 128) * 128
    routing = routing_from_counts(counts, m_cap)
    expected_m = T * 8 // 256
    assert gs.sm90_launch_config(m_cap, E, K, True) == (False, False, gs.TILE_N)
    assert gs.sm90_launch_config(m_cap, E, K, True, expected_m=expected_m) == (True, False, gs.WIDE_TILE_N)
    assert gs.sm90_swiglu_tile(m_cap, E, K, True, expected_m) == gs.WIDE_TILE_N
    assert gs.sm90_swiglu_tile(m_cap, E, K, True) == gs.TILE_N
    g = torch.Generator(device="cuda").manual_seed(11)
    w13, w13_scale = expert_weights(E, 2 * inter, K, g)
    a, a_scale = activations(routing, K, g)
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    op = torch.ops.cute_moe
    real = routing.real
    poison_pools(max(256 << 20, m_cap * inter * 8))
    h = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, routing.offsets, cnt)
    h_hint = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, routing.offsets, cnt, expected_m)
    assert not h_hint[real].isnan().any() and torch.equal(h[real], h_hint[real])
    q, s = op.grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, routing.offsets, cnt, True, None)
    q_hint, s_hint = op.grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, routing.offsets, cnt, True, None,
                                                expected_m)  # fmt: skip
    assert not s_hint[real].isnan().any() and torch.equal(s[real], s_hint[real])
    assert torch.equal(q[real].view(torch.uint8), q_hint[real].view(torch.uint8))


# ----------------------------------------------------------------------------- no real row


@pytest.mark.parametrize("counted", [True, False], ids=["counts", "no_counts"])
@pytest.mark.parametrize("tile_n", [gs.TILE_N, gs.WIDE_TILE_N], ids=["tile128", "tile256"])
@pytest.mark.parametrize("m_cap", [0, 256], ids=["zero_rows", "all_experts_empty"])
def test_no_real_rows(m_cap, tile_n, counted):
    """T = 0 (M_cap = 0: the launch returns before the kernel) and every expert empty (M_cap = 256,
    expert_offsets all 0, A's rows all NaN: the kernel runs and its scheduler finds no tile): each
    width of the one kernel, forced, and the op (the rule's choice) return codes and scales of the
    two kernels' shapes, dtypes and strides, and the launches complete (synchronize: no fault, no
    hang).  No row lies inside a segment, so no value is defined to compare (rows past
    ``expert_offsets[-1]`` are unspecified)."""
    from cute_moe.kernels import grouped_gemm_sm90 as g90

    E, inter, K = 8, 256, 2048
    routing = routing_from_counts([0] * E, m_cap=m_cap)
    g = torch.Generator(device="cuda").manual_seed(61 + m_cap + tile_n + counted)
    w13, w13_scale = expert_weights(E, 2 * inter, K, g)
    a, a_scale = activations(routing, K, g)
    cnt = torch.zeros(E, dtype=torch.int32, device="cuda") if counted else None
    op = torch.ops.cute_moe
    poison_pools(256 << 20)
    q, s = g90.grouped_gemm_fp8_swiglu_cuda(a, a_scale, w13, w13_scale, routing.offsets, cnt, tile_n=tile_n)
    q_op, s_op = op.grouped_gemm_fp8_swiglu(a, a_scale, w13, w13_scale, routing.offsets, cnt, True, None)
    h = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, routing.offsets, cnt)
    q2, s2 = op.silu_mul_quant(h, routing.offsets, True, None, cnt)
    torch.cuda.synchronize()
    for qq, ss in ((q, s), (q_op, s_op)):
        assert qq.shape == q2.shape == (m_cap, inter) and qq.dtype == q2.dtype == torch.float8_e4m3fn
        assert ss.shape == s2.shape == (m_cap, inter // BLOCK) and ss.dtype == torch.float32
        assert ss.stride() == s2.stride()


# ----------------------------------------------------------------------------- CUDA graphs


def _counts(routing: Routing) -> torch.Tensor:
    """int32 [E]: the real rows of each segment (align's expert_counts; real rows lead their segment)."""
    csum = torch.cat([routing.real.new_zeros(1, dtype=torch.long), routing.real.long().cumsum(0)])
    off = routing.offsets.long()
    return (csum[off[1:]] - csum[off[:-1]]).to(torch.int32)


def _graph_case(regime: str):
    """(E, I, K, the rule's tile width, gate_first, scale_fmt, first routing, later routings), every
    routing of one M_cap and E (what a captured graph replays on).

    decode: top-8 of 16 tokens over 64 experts through align_ref (M_cap = 8320: well under one real
    tile per expert), later one routing with every token on the same 8 experts.  prefill:
    DeepGEMM-like counts of ~384 rows over 64 experts at K = 4096 (M_cap = 40960: 4 real tiles per
    expert by the rule's estimate, pairs along M), later empty experts, every row on one expert,
    every expert empty, then ragged again."""
    if regime == "decode":
        first = routing_from_topk(16, 8, 64, 71)
        later = [routing_from_topk(16, 8, 64, 72), routing_from_topk(16, 8, 64, 73, one_hot_experts=True),
                 routing_from_topk(16, 8, 64, 74)]  # fmt: skip
        return 64, 256, 2048, gs.TILE_N, True, None, first, later
    first, later = prefill_graph_routings(64, 384, seed=81)
    return 64, 256, 4096, gs.WIDE_TILE_N, False, "ue8m0", first, later


def _check_against_two_kernels(q, s, args, real: torch.Tensor, what: str) -> None:
    """q, s against grouped_gemm_fp8 then silu_mul_quant run now on the same inputs ``args``: the
    same bits on every real row, none of them NaN (the outputs were poisoned before the run)."""
    op = torch.ops.cute_moe
    a, a_scale, w13, w13_scale, offsets, cnt, gate_first, scale_fmt = args
    h = op.grouped_gemm_fp8(a, a_scale, w13, w13_scale, offsets, cnt)
    q2, s2 = op.silu_mul_quant(h, offsets, gate_first, scale_fmt, cnt)
    assert q.shape == q2.shape and s.shape == s2.shape and s.stride() == s2.stride()
    qr, sr, q2r, s2r = q[real], s[real], q2[real], s2[real]
    assert not sr.isnan().any() and not qr.float().isnan().any(), f"{what}: unwritten or NaN real rows"
    assert torch.equal(sr, s2r), f"{what}: {(sr != s2r).sum().item()} scales differ"
    assert torch.equal(qr.view(torch.uint8), q2r.view(torch.uint8)), \
        f"{what}: {(qr.view(torch.uint8) != q2r.view(torch.uint8)).sum().item()} codes differ"


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_cuda_graph_capture_once_replay_new_inputs(regime):
    """The op with expert counts (as fused_moe calls it) captured once in a CUDA graph, then replayed
    on new routings: new offsets, counts, A codes and A scales copied into the captured buffers
    (rows past the last segment NaN), the outputs filled with NaN codes and scales before each
    replay.  The rule's width for the captured M_cap is asserted (128 at decode, 256 at prefill);
    each replay equals the two kernels run afresh on its inputs on every real row, every expert
    empty included (a replay with nothing to write, followed by one with rows again)."""
    E, inter, K, width, gate_first, scale_fmt, first, later = _graph_case(regime)
    assert gs.sm90_swiglu_tile(first.m_cap, E, K, True) == width, "the rule must take this width"
    seed = sum(map(ord, regime))
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w13_scale = expert_weights(E, 2 * inter, K, g)
    a, a_scale = activations(first, K, g)
    offsets, cnt = first.offsets, _counts(first)
    args = (a, a_scale, w13, w13_scale, offsets, cnt, gate_first, scale_fmt)
    op = torch.ops.cute_moe
    poison_pools(max(256 << 20, first.m_cap * inter * 8))
    q, s = op.grouped_gemm_fp8_swiglu(*args)  # eager: compiles every kernel before the capture
    _check_against_two_kernels(q, s, args, first.real, f"{regime} eager")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = op.grouped_gemm_fp8_swiglu(*args)
    for i, routing in enumerate(later):
        assert routing.m_cap == first.m_cap and routing.offsets.shape == offsets.shape
        new_a, new_scale = activations(routing, K, torch.Generator(device="cuda").manual_seed(seed + 1 + i))
        a.copy_(new_a)
        a_scale.copy_(new_scale)
        offsets.copy_(routing.offsets)
        cnt.copy_(_counts(routing))
        q.view(torch.uint8).fill_(0xFF)  # e4m3 NaN
        s.fill_(float("nan"))
        graph.replay()
        _check_against_two_kernels(q, s, args, routing.real, f"{regime} replay {i}")
    del graph
