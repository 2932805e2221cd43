"""grouped_gemm_fp8's Hopper CuTe DSL kernel against the reference, on the GPU.

The launch function ``grouped_gemm_fp8_cuda(a, a_scale, b, b_scale, expert_offsets)``
is called directly on fresh random data per case:

* B: random weights with a per-128x128-block magnitude spread (so that a wrong
  block scale shows), quantized by ``reference.quant_block_128x128_ref``.
* A: random activations with a per-(row, 128-group) magnitude spread, quantized by
  ``reference.quant_fp8_ref`` with MN-major scales (strides ``(1, M_cap)``), as
  ``permute_quant`` writes them; padding rows inside a segment are zero (zero
  codes, the scale of an all-zero group); rows past ``expert_offsets[-1]`` hold
  NaN codes and NaN scales (no kernel may read them, and a row never leaks into
  another row).
* Segments are padded to 128 rows (``align``'s alignment): counts drawn like
  DeepGEMM's tests (expected x U(0.7, 1.3)), decode sizes (1-16 rows per expert),
  empty experts (first and last included), every row on one expert, M_cap up to
  65536, and routings from ``reference.align_ref`` on random top-8 ids over 256
  experts (DeepSeek-V3 decode, T = 1 and 128).
* C comes from a NaN-poisoned allocator.  Acceptance on rows ``< expert_offsets[-1]``
  against ``reference.grouped_gemm_fp8_ref`` (exact 128-wide block sums, f32
  promotion): no NaN; relative L2 error <= 5e-3 over all rows and over every
  non-empty segment (a wrong expert on a small segment cannot hide behind a large
  one); <= 2e-2 on every real row; padding rows exactly zero (with expert counts:
  padding rows unchecked, the contract leaves them unspecified).  Rows past the last
  segment are unspecified.

The shape set samples the cross product of K in {7168, 2048, 4096, 1536} and
N in {4096, 7168, 2112, 512, 256} (every value at least once, the DeepSeek-V3
GEMMs N x K = 4096 x 7168 and 7168 x 2048 in every regime) over 1, 8, 32 and 256
experts: six (N, K) pairs, so the file's run time stays under a minute on an
H200 as long as the kernel's compile key does not include N or K.

Also: CUDA-graph capture once, replay with new routings written in place (same
M_cap), a side stream, and one compiled function serving two routings (no
recompile: the compile cache, when the module exposes
``compile_grouped_gemm_fp8.cache``, does not grow; results deterministic).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from cute_moe.reference import align_ref, grouped_gemm_fp8_ref, quant_block_128x128_ref, quant_fp8_ref

from cute_moe.kernels.grouped_gemm_schedule import cluster_along_m, wide_tile

from .moe_cases import poison_pools, zero_pools_for

gg = pytest.importorskip("cute_moe.kernels.grouped_gemm_sm90")

pytestmark = pytest.mark.gpu

BLOCK = 128
REL_L2 = 5e-3  # the acceptance bound, whole output and every segment
ROW_REL_L2 = 2e-2  # every real row: catches row / scale-row mix-ups in big problems
FP8 = torch.float8_e4m3fn


def _round_up(x: int, a: int = BLOCK) -> int:
    return -(-x // a) * a


# ----------------------------------------------------------------------------- routings


def deepgemm_counts(E: int, expected: int, rng: random.Random) -> list[int]:
    """DeepGEMM's contiguous-layout test draw: int(expected * U(0.7, 1.3)) rows per expert."""
    return [int(expected * rng.uniform(0.7, 1.3)) for _ in range(E)]


def empty_counts(E: int, expected: int, rng: random.Random) -> list[int]:
    """Ragged, with the first, the last and about half of the other experts empty."""
    counts = deepgemm_counts(E, expected, rng)
    for e in range(E):
        if e in (0, E - 1) or rng.random() < 0.5:
            counts[e] = 0
    return counts


def decode_counts(E: int, rng: random.Random) -> list[int]:
    """1-16 rows per expert, about a quarter of the experts empty."""
    return [0 if rng.random() < 0.25 else rng.randint(1, 16) for _ in range(E)]


def one_expert_counts(E: int, expert: int, rows: int) -> list[int]:
    return [rows if e == expert else 0 for e in range(E)]


@dataclass
class Routing:
    offsets: torch.Tensor  # int32 [E + 1] on the GPU, segments padded to 128 rows
    real: torch.Tensor  # bool [M_cap]: rows that hold a routed token (the rest of a segment is padding)
    m_cap: int

    @property
    def end(self) -> int:
        return int(self.offsets[-1])


def routing_from_counts(counts: list[int], m_cap: int | None = None) -> Routing:
    """Padded offsets from counts; M_cap leaves 128 rows past the last segment unless given."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + _round_up(c))
    end = offsets[-1]
    m_cap = end + BLOCK if m_cap is None else m_cap
    assert end <= m_cap, (end, m_cap)
    real = torch.zeros(m_cap, dtype=torch.bool, device="cuda")
    for lo, c in zip(offsets, counts):
        if c:
            real[lo : lo + c] = True
    return Routing(torch.tensor(offsets, dtype=torch.int32, device="cuda"), real, m_cap)


def routing_from_topk(T: int, k: int, E: int, seed: int, one_hot_experts: bool = False) -> Routing:
    """align_ref (alignment 128) on random top-k ids: M_cap = m_cap(T, k, E), as the pipeline has it.

    ``one_hot_experts``: every token picks the same k experts (same M_cap, few segments).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(1 if one_hot_experts else T, E, generator=g, device="cuda").expand(T, E)
    ids = scores.argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    offsets, row_to_token, _, _ = align_ref(ids, E, BLOCK)
    return Routing(offsets, row_to_token >= 0, row_to_token.shape[0])


# ----------------------------------------------------------------------------- operands


def expert_weights(E: int, N: int, K: int, g: torch.Generator):
    """(b fp8 [E, N, K], b_scale f32 [E, ceil(N/128), K/128]) from random bf16 weights.

    Magnitudes 0.02 * 10**U(-0.5, 0.5) per 128x128 block, so block scales differ;
    quantized in chunks of experts to bound the f32 working set (E=256 x 4096 x 7168).
    """
    nb, kb = -(-N // BLOCK), K // BLOCK
    b = torch.empty(E, N, K, dtype=FP8, device="cuda")
    b_scale = torch.empty(E, nb, kb, dtype=torch.float32, device="cuda")
    step = max(1, (1 << 28) // (N * K))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w = torch.randn(e1 - e0, N, K, generator=g, device="cuda")
        mag = 0.02 * torch.pow(10.0, torch.empty(e1 - e0, nb, kb, device="cuda").uniform_(-0.5, 0.5, generator=g))
        w.view(e1 - e0, N, kb, BLOCK).mul_(mag.repeat_interleave(BLOCK, dim=1)[:, :N, :, None])
        b[e0:e1], b_scale[e0:e1] = quant_block_128x128_ref(w.to(torch.bfloat16))
        del w
    return b, b_scale


def activations(routing: Routing, K: int, g: torch.Generator):
    """(a fp8 [M_cap, K], a_scale f32 [M_cap, K/128] MN-major): random real rows, zero padding rows,
    NaN codes and scales past the last segment."""
    m_cap, end = routing.m_cap, routing.end
    x = torch.randn(m_cap, K, generator=g, device="cuda")
    x.view(m_cap, K // BLOCK, BLOCK).mul_(
        torch.pow(10.0, torch.empty(m_cap, K // BLOCK, 1, device="cuda").uniform_(-1, 1, generator=g))
    )
    x[~routing.real] = 0
    a, a_scale = quant_fp8_ref(x.to(torch.bfloat16), BLOCK, column_major_scales=True)
    assert m_cap == 0 or a_scale.stride() == (1, m_cap)
    a.view(torch.uint8)[end:] = 0x7F  # e4m3fn NaN
    a_scale[end:] = float("nan")
    return a, a_scale


@dataclass
class Problem:
    a: torch.Tensor
    a_scale: torch.Tensor
    b: torch.Tensor
    b_scale: torch.Tensor
    routing: Routing

    def args(self):
        return self.a, self.a_scale, self.b, self.b_scale, self.routing.offsets


def make_problem(E: int, N: int, K: int, routing: Routing, seed: int) -> Problem:
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, b_scale = expert_weights(E, N, K, g)
    assert routing.offsets.shape == (E + 1,)
    return Problem(*activations(routing, K, g), b, b_scale, routing)


def reroute(p: Problem, routing: Routing, seed: int) -> None:
    """New routing and new A written in place (same M_cap): what a CUDA graph replays on."""
    assert routing.m_cap == p.routing.m_cap and routing.offsets.shape == p.routing.offsets.shape
    a, a_scale = activations(routing, p.a.shape[1], torch.Generator(device="cuda").manual_seed(seed))
    p.a.copy_(a)
    p.a_scale.copy_(a_scale)
    p.routing.offsets.copy_(routing.offsets)
    p.routing = Routing(p.routing.offsets, routing.real, routing.m_cap)


# ----------------------------------------------------------------------------- checks


def check_output(c: torch.Tensor, p: Problem, ref: torch.Tensor | None = None,
                 padding_unspecified: bool = False) -> None:  # fmt: skip
    """c against grouped_gemm_fp8_ref on rows < expert_offsets[-1] (see the module docstring).
    ``padding_unspecified`` (a call with expert counts): the padding rows are not checked."""
    m_cap, N = p.a.shape[0], p.b.shape[1]
    assert c.shape == (m_cap, N) and c.dtype == torch.bfloat16, (c.shape, c.dtype)
    end = p.routing.end
    if end == 0:
        return
    if ref is None:
        ref = grouped_gemm_fp8_ref(*p.args())
    want = ref[:end].float()
    real = p.routing.real[:end]
    if padding_unspecified:  # only the real rows are read: the padding rows hold whatever was in memory
        got = want.clone()
        got[real] = c[:end][real].float()
    else:
        got = c[:end].float()
    nan_rows = int(got.isnan().any(dim=1).sum())
    assert nan_rows == 0, f"NaN in {nan_rows} of {end} rows (unwritten, or poisoned rows read)"
    diff2, ref2 = (got - want).pow(2).sum(dim=1), want.pow(2).sum(dim=1)

    pad_rows = (~real).nonzero().flatten()
    if pad_rows.numel() and not padding_unspecified:
        bad = int((got[pad_rows] != 0).any(dim=1).sum())
        assert bad == 0, f"{bad} padding rows (zero A) are not zero"

    rel = (diff2.sum() / ref2.sum()).sqrt().item()
    assert rel <= REL_L2, f"relative L2 error {rel:.3e} over {end} rows"

    offsets = p.routing.offsets.long()
    seg = torch.searchsorted(offsets[1:], torch.arange(end, device=c.device), right=True)
    E = offsets.shape[0] - 1
    seg_diff = torch.zeros(E, device=c.device, dtype=torch.float64).index_add_(0, seg, diff2.double())
    seg_ref = torch.zeros(E, device=c.device, dtype=torch.float64).index_add_(0, seg, ref2.double())
    nonempty = seg_ref > 0
    seg_rel = (seg_diff[nonempty] / seg_ref[nonempty]).sqrt()
    worst = int(seg_rel.argmax()) if seg_rel.numel() else 0
    assert seg_rel.numel() == 0 or seg_rel.max().item() <= REL_L2, (
        f"expert {int(nonempty.nonzero().flatten()[worst])}: relative L2 error {seg_rel.max().item():.3e}"
    )

    row_rel = (diff2[real] / ref2[real].clamp_min(1e-30)).sqrt()
    assert row_rel.numel() == 0 or row_rel.max().item() <= ROW_REL_L2, (
        f"worst row relative L2 error {row_rel.max().item():.3e} "
        f"({int((row_rel > ROW_REL_L2).sum())} rows above {ROW_REL_L2})"
    )


def run_checked(p: Problem, variant: dict | None = None) -> torch.Tensor:
    """One call with C from a poisoned allocator, checked against the reference."""
    poison_pools(max(256 << 20, p.a.shape[0] * p.b.shape[1] * 2 + (64 << 20)))
    c = gg.grouped_gemm_fp8_cuda(*p.args(), **(variant or {}))
    check_output(c, p)
    return c


# ----------------------------------------------------------------------------- cases

# id -> (E, N, K, routing builder(seed) -> Routing)
CASES = {
    # DeepSeek-V3 GEMMs, DeepGEMM-style ragged contiguous layout
    "dsv3_w13_E8_ragged": (8, 4096, 7168, lambda s: routing_from_counts(deepgemm_counts(8, 4096, random.Random(s)))),
    "dsv3_w2_E8_ragged": (8, 7168, 2048, lambda s: routing_from_counts(deepgemm_counts(8, 4096, random.Random(s)))),
    "dsv3_w13_E32_ep": (32, 4096, 7168, lambda s: routing_from_counts(deepgemm_counts(32, 512, random.Random(s)))),
    # one expert; N = 2112 ends in a half-filled 128-row scale block
    "E1_N2112_K7168": (1, 2112, 7168, lambda s: routing_from_counts([1000])),
    "E32_N512_K4096_ragged": (32, 512, 4096, lambda s: routing_from_counts(deepgemm_counts(32, 384, random.Random(s)))),
    # empty experts (first, last and about half)
    "E32_N256_K1536_empty": (32, 256, 1536, lambda s: routing_from_counts(empty_counts(32, 512, random.Random(s)))),
    "dsv3_w2_E256_empty": (256, 7168, 2048, lambda s: routing_from_counts(empty_counts(256, 96, random.Random(s)))),
    # every row on one expert
    "E32_N4096_K1536_last_expert": (32, 4096, 1536, lambda s: routing_from_counts(one_expert_counts(32, 31, 5000))),
    "dsv3_w2_E8_first_expert": (8, 7168, 2048, lambda s: routing_from_counts(one_expert_counts(8, 0, 3000))),
    # M_cap = 65536
    "dsv3_w2_E8_Mcap65536_ragged": (
        8, 7168, 2048, lambda s: routing_from_counts(deepgemm_counts(8, 6144, random.Random(s)), m_cap=65536)),
    "E8_N512_K4096_Mcap65536_one_expert": (
        8, 512, 4096, lambda s: routing_from_counts(one_expert_counts(8, 3, 65536), m_cap=65536)),
    # decode: 1-16 rows per expert
    "dsv3_w13_E256_decode": (256, 4096, 7168, lambda s: routing_from_counts(decode_counts(256, random.Random(s)))),
    "dsv3_w2_E256_decode": (256, 7168, 2048, lambda s: routing_from_counts(decode_counts(256, random.Random(s)))),
    "E8_N256_K1536_decode": (8, 256, 1536, lambda s: routing_from_counts(decode_counts(8, random.Random(s)))),
    # more than 256 experts (the expert lookup's second round of 8 loads per lane), and an expert
    # count that is not a multiple of 32
    "E384_N512_K1024_decode": (384, 512, 1024, lambda s: routing_from_counts(decode_counts(384, random.Random(s)))),
    "E300_N256_K512_empty": (300, 256, 512, lambda s: routing_from_counts(empty_counts(300, 40, random.Random(s)))),
    # DeepSeek-V3 decode routing: top-8 of 256 experts through align_ref
    "dsv3_w13_E256_T1": (256, 4096, 7168, lambda s: routing_from_topk(1, 8, 256, s)),
    "E256_N2112_K7168_T128": (256, 2112, 7168, lambda s: routing_from_topk(128, 8, 256, s)),
    "dsv3_w2_E256_T16_same_experts": (
        256, 7168, 2048, lambda s: routing_from_topk(16, 8, 256, s, one_hot_experts=True)),
    # odd K block counts (1 and 3: the main loop's odd tail; the K values above are all even)
    "E4_N256_K128": (4, 256, 128, lambda s: routing_from_counts(deepgemm_counts(4, 200, random.Random(s)))),
    "E8_N384_K384_ragged": (8, 384, 384, lambda s: routing_from_counts(empty_counts(8, 300, random.Random(s)))),
    # with counts, tiles of at most 64 real rows take the direct-store epilogue: around that bound,
    # empty, full and two-tile segments, and N = 2112 (a last N tile of 64 columns)
    "E10_N2112_K512_sparse_edge": (
        10, 2112, 512, lambda s: routing_from_counts([1, 16, 17, 0, 63, 64, 65, 128, 2, 192])),
}  # fmt: skip


# Every kernel variant on every case, forced: the cluster direction (pairs of N tiles sharing A, or
# of M tiles sharing B, which the launch picks only for prefill MoE shapes), the epilogue (the
# store-behind one, which it picks for K <= 2048) and the tile's width (256, in two halves, which it
# picks for prefill).
_FORCED = [(m, s, n) for n in (128, 256) for m in (False, True) for s in (False, True)]
VARIANTS = pytest.mark.parametrize(
    "variant",
    [{"along_m": m, "store_behind": s, "tile_n": n} for m, s, n in _FORCED],
    ids=[f"pairs_{'m' if m else 'n'}-{'store_behind' if s else 'store_wait'}-tile{n}" for m, s, n in _FORCED],
)


@VARIANTS
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_fp8(case, variant):
    E, N, K, build = CASES[case]
    seed = sum(map(ord, case)) * 7919
    run_checked(make_problem(E, N, K, build(seed), seed), variant)


@pytest.mark.parametrize("case", ["dsv3_w13_E256_T1", "dsv3_w2_E256_decode", "E8_N256_K1536_decode",
                                  "dsv3_w13_E8_ragged", "E8_N384_K384_ragged", "E384_N512_K1024_decode",
                                  "E10_N2112_K512_sparse_edge"])  # fmt: skip
@VARIANTS
def test_grouped_gemm_fp8_with_expert_counts(case, variant):
    """With align's counts a warp group whose 64 rows are all padding skips its math and a tile of at
    most 64 real rows writes those rows only: real rows as without counts (check_output), padding
    rows unspecified (the output comes from a poisoned allocator: a real row left unwritten is NaN)."""
    E, N, K, build = CASES[case]
    seed = sum(map(ord, case)) * 7919 + 1
    p = make_problem(E, N, K, build(seed), seed)
    offsets = p.routing.offsets.long()
    real = p.routing.real.long()
    counts = torch.stack([real[offsets[e] : offsets[e + 1]].sum() for e in range(E)]).to(torch.int32)
    poison_pools(max(256 << 20, p.a.shape[0] * N * 2 + (64 << 20)))
    c = gg.grouped_gemm_fp8_cuda(*p.args(), counts, **variant)
    check_output(c, p, padding_unspecified=True)


@VARIANTS
def test_grouped_gemm_fp8_with_expert_counts_over_padded_segments(variant):
    """Segments padded past their count's next multiple of 128 (a direct call may size them so):
    an expert with no real rows in a 128-row segment, one with 5 in 512 rows (three tiles with no
    real row, where the w13 variant loads 16 of A's rows), one full.  Real rows as the reference."""
    offsets = torch.tensor([0, 128, 640, 768], dtype=torch.int32, device="cuda")
    real = torch.zeros(896, dtype=torch.bool, device="cuda")
    real[128:133] = True
    real[640:768] = True
    p = make_problem(3, 384, 4096, Routing(offsets, real, 896), seed=35)
    counts = torch.tensor([0, 5, 128], dtype=torch.int32, device="cuda")
    poison_pools(256 << 20)
    c = gg.grouped_gemm_fp8_cuda(*p.args(), counts, **variant)
    check_output(c, p, padding_unspecified=True)


@pytest.mark.parametrize("case", ["dsv3_w2_E256_decode", "dsv3_w13_E8_ragged"])
@VARIANTS
def test_grouped_gemm_fp8_with_expert_counts_ignores_padding_garbage(case, variant):
    """Inside fused_moe, A's padding rows are never written (permute_quant with zero_padding=False):
    with garbage there (NaN codes and NaN scales included), the real rows are unchanged."""
    E, N, K, build = CASES[case]
    seed = sum(map(ord, case)) * 7919 + 2
    p = make_problem(E, N, K, build(seed), seed)
    offsets = p.routing.offsets.long()
    real = p.routing.real
    counts = torch.stack([real[offsets[e] : offsets[e + 1]].long().sum() for e in range(E)]).to(torch.int32)
    want = grouped_gemm_fp8_ref(*p.args())
    pad = (~real).nonzero().flatten()
    assert pad.numel()
    garbage = torch.randint(0, 256, (pad.numel(), K), dtype=torch.uint8, device="cuda")
    garbage[:, ::7] = 0x7F  # e4m3 NaN
    p.a.view(torch.uint8)[pad] = garbage
    p.a_scale[pad] = float("nan")
    poison_pools(max(256 << 20, p.a.shape[0] * N * 2 + (64 << 20)))  # a real row left unwritten reads NaN
    c = gg.grouped_gemm_fp8_cuda(*p.args(), counts, **variant)
    rows = real.nonzero().flatten()
    got, ref = c[rows].float(), want[rows].float()
    assert not got.isnan().any()
    assert ((got - ref).norm() / ref.norm()).item() <= REL_L2


def test_grouped_gemm_fp8_op_runs_this_kernel():
    """torch.ops.cute_moe.grouped_gemm_fp8 on the GPU is this kernel (bit-identical output on the
    rows it defines: the 128 rows past the last segment are unspecified, fresh memory each call)."""
    p = make_problem(8, 512, 2048, routing_from_counts(deepgemm_counts(8, 300, random.Random(5))), seed=5)
    want = gg.grouped_gemm_fp8_cuda(*p.args())
    poison_pools(256 << 20)
    got = torch.ops.cute_moe.grouped_gemm_fp8(*p.args())
    check_output(got, p)
    end = p.routing.end
    assert torch.equal(got[:end], want[:end])


def test_grouped_gemm_fp8_misaligned_segments_give_nan():
    """Segments that are not multiples of 128 rows: the tiles they touch are NaN, never plausible
    wrong values; a tile of an aligned segment is still right."""
    routing = routing_from_counts([128, 72, 184])  # finite A rows up to 512
    p = make_problem(3, 256, 1024, routing, seed=31)
    p.routing.offsets.copy_(torch.tensor([0, 128, 200, 384], dtype=torch.int32))
    zero_pools_for(p.a.shape[0] * 256 * 2)  # zeros, not NaN: NaN left in memory would pass unwritten
    c = gg.grouped_gemm_fp8_cuda(*p.args())
    want = grouped_gemm_fp8_ref(p.a[:128], p.a_scale[:128], p.b, p.b_scale,
                                torch.tensor([0, 128, 128, 128], dtype=torch.int32, device="cuda"))  # fmt: skip
    rel = ((c[:128].float() - want.float()).norm() / want.float().norm()).item()
    assert rel <= REL_L2
    assert bool(c[128:384].isnan().all()), "a misaligned segment's tiles must be NaN"


@VARIANTS
def test_grouped_gemm_fp8_misaligned_segments_give_nan_with_counts(variant):
    """With expert counts too, a misaligned segment's tiles are written whole as NaN: a tile of a
    few real rows must not take the epilogue that writes those rows only (rows it leaves unwritten
    would keep what the allocator held: zeros here, a plausible answer)."""
    routing = routing_from_counts([128, 72, 184])
    p = make_problem(3, 256, 1024, routing, seed=34)
    p.routing.offsets.copy_(torch.tensor([0, 128, 200, 384], dtype=torch.int32))
    counts = torch.tensor([128, 40, 100], dtype=torch.int32, device="cuda")
    zero_pools_for(p.a.shape[0] * 256 * 2)  # the output gets zeros, not NaN
    c = gg.grouped_gemm_fp8_cuda(*p.args(), counts, **variant)
    assert bool(c[128:384].isnan().all()), "a misaligned segment's tiles must be NaN"


def test_grouped_gemm_fp8_rejects_unaligned_a_scale():
    p = make_problem(2, 256, 512, routing_from_counts([128, 0]), seed=32)
    odd_stride = torch.empty(p.a_scale.shape[1], p.a_scale.shape[0] + 1, device="cuda")[:, : p.a_scale.shape[0]].t()
    odd_stride.copy_(p.a_scale)
    with pytest.raises(ValueError, match="a_scale"):
        gg.grouped_gemm_fp8_cuda(p.a, odd_stride, p.b, p.b_scale, p.routing.offsets)


def test_grouped_gemm_fp8_op_checks_tma_operands_on_cuda():
    """The op's CUDA path refuses an A whose base or B whose row stride is not a multiple of 16 bytes
    (TMA) with a ValueError naming the argument, and takes weights held as an nn.Parameter."""
    p = make_problem(2, 256, 512, routing_from_counts([128, 0]), seed=33)
    op = torch.ops.cute_moe.grouped_gemm_fp8
    shifted = torch.empty(p.a.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(p.a.shape)
    shifted.copy_(p.a.view(torch.uint8))
    with pytest.raises(ValueError, match="cute_moe.grouped_gemm_fp8: a must be 16-byte aligned"):
        op(shifted.view(p.a.dtype), p.a_scale, p.b, p.b_scale, p.routing.offsets)
    wide = torch.empty(*p.b.shape[:2], p.b.shape[2] + 8, dtype=torch.uint8, device="cuda")[:, :, : p.b.shape[2]]
    wide.copy_(p.b.view(torch.uint8))
    with pytest.raises(ValueError, match="cute_moe.grouped_gemm_fp8: b strides must be multiples of 16 bytes"):
        op(p.a, p.a_scale, wide.view(p.b.dtype), p.b_scale, p.routing.offsets)
    as_parameter = torch.nn.Parameter(p.b, requires_grad=False)
    poison_pools(256 << 20)
    got = op(p.a, p.a_scale, as_parameter, p.b_scale, p.routing.offsets)[:128]
    assert not got.isnan().any(), "unwritten rows"
    assert torch.equal(got, op(*p.args())[:128])


def test_grouped_gemm_fp8_all_experts_empty():
    p = make_problem(8, 512, 4096, routing_from_counts([0] * 8, m_cap=256), seed=11)
    c = gg.grouped_gemm_fp8_cuda(*p.args())
    torch.cuda.synchronize()
    assert c.shape == (256, 512) and c.dtype == torch.bfloat16


def test_grouped_gemm_fp8_zero_rows():
    # T = 0: M_cap = 0, every segment empty.
    p = make_problem(4, 256, 1536, routing_from_counts([0] * 4, m_cap=0), seed=12)
    c = gg.grouped_gemm_fp8_cuda(*p.args())
    torch.cuda.synchronize()
    assert c.shape == (0, 256) and c.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- no recompilation, CUDA graphs


def _cache_size():
    fn = getattr(gg, "compile_grouped_gemm_fp8", None)
    cache = getattr(fn, "cache", None)
    return None if cache is None else len(cache)


def test_grouped_gemm_fp8_routing_is_not_compiled_in():
    """One compiled function serves two routings of one (M_cap, E, N, K); results are deterministic."""
    E, N, K, m_cap = 32, 512, 4096, 32 * (_round_up(int(384 * 1.3)) + BLOCK)
    first = routing_from_counts(deepgemm_counts(E, 384, random.Random(21)), m_cap=m_cap)
    second = routing_from_counts(empty_counts(E, 384, random.Random(22)), m_cap=m_cap)
    p = make_problem(E, N, K, first, seed=23)
    c1 = run_checked(p).clone()
    size = _cache_size()

    saved_a, saved_scale, saved_offsets, saved_real = p.a.clone(), p.a_scale.clone(), first.offsets.clone(), first.real
    reroute(p, second, seed=24)  # writes the first routing's offsets tensor in place
    run_checked(p)
    if size is not None:
        assert _cache_size() == size, "a new routing of the same shapes compiled a new variant"

    p.a.copy_(saved_a)
    p.a_scale.copy_(saved_scale)
    p.routing.offsets.copy_(saved_offsets)
    p.routing = Routing(p.routing.offsets, saved_real, m_cap)
    # Poisoned first: c1 and the output of the second routing are freed or alive, and an unwritten
    # `again` reusing a buffer that held c1's bits could otherwise pass the comparison below.
    poison_pools(max(256 << 20, m_cap * N * 2 + (64 << 20)))
    again = gg.grouped_gemm_fp8_cuda(*p.args())
    end = p.routing.end
    assert torch.equal(again[:end].view(torch.int16), c1[:end].view(torch.int16)), "not deterministic"
    if size is not None:
        assert _cache_size() == size


def prefill_graph_routings(E: int, expected: int, seed: int) -> tuple[Routing, list[Routing]]:
    """(first routing, later routings), all of one M_cap (what a captured graph replays on): DeepGEMM-
    like counts of ~``expected`` rows per expert, then again, some experts empty, every row on one
    expert, every expert empty, ragged and fewer."""
    m_cap = E * (_round_up(int(expected * 1.3)) + BLOCK)
    later = [
        routing_from_counts(deepgemm_counts(E, expected, random.Random(seed + 1)), m_cap=m_cap),
        routing_from_counts(empty_counts(E, expected, random.Random(seed + 2)), m_cap=m_cap),
        routing_from_counts(one_expert_counts(E, 5, m_cap - BLOCK), m_cap=m_cap),
        routing_from_counts([0] * E, m_cap=m_cap),
        routing_from_counts(deepgemm_counts(E, expected * 4 // 5, random.Random(seed + 3)), m_cap=m_cap),
    ]
    return routing_from_counts(deepgemm_counts(E, expected, random.Random(seed)), m_cap=m_cap), later


# regime -> (E, N, K, first routing, later routings (same M_cap))
def _prefill_graph_case(E: int = 8, N: int = 7168, K: int = 2048, expected: int = 512):
    return E, N, K, *prefill_graph_routings(E, expected, seed=31)


def _decode_graph_case():
    later = [routing_from_topk(16, 8, 256, 42), routing_from_topk(16, 8, 256, 43, one_hot_experts=True),
             routing_from_topk(16, 8, 256, 44)]  # fmt: skip
    return 256, 4096, 7168, routing_from_topk(16, 8, 256, 41), later


@pytest.mark.parametrize("regime", ["prefill", "prefill_pairs_m", "decode"])
def test_grouped_gemm_fp8_side_stream_and_cuda_graph(regime):
    """prefill_pairs_m is a shape whose launches pair M tiles (cluster_along_m), the others N tiles."""
    cases = {"prefill": _prefill_graph_case, "prefill_pairs_m": lambda: _prefill_graph_case(64, 256, 4096, 384),
             "decode": _decode_graph_case}  # fmt: skip
    E, N, K, first, later = cases[regime]()
    wide = wide_tile(first.m_cap, E, K, False)
    assert cluster_along_m(first.m_cap, E, K, wide, has_counts=False) == (regime == "prefill_pairs_m")
    p = make_problem(E, N, K, first, seed=sum(map(ord, regime)))
    run_checked(p)  # compiles before capture

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # Poisoned on the side stream itself: the caching allocator keeps free blocks per stream, so
        # poison written on the default stream would never reach an allocation made here.
        poison_pools(max(256 << 20, p.a.shape[0] * N * 2 + (64 << 20)))
        c = gg.grouped_gemm_fp8_cuda(*p.args())
    torch.cuda.current_stream().wait_stream(stream)
    check_output(c, p)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c_g = gg.grouped_gemm_fp8_cuda(*p.args())
    for i, routing in enumerate(later):
        reroute(p, routing, seed=60 + i)
        c_g.fill_(float("nan"))
        graph.replay()
        check_output(c_g, p)
