"""permute_quant's and permute's CuTe DSL kernels against the references, on the GPU.

The kernels' launch functions are called directly (``permute_quant_cuda``,
``permute_cuda``) on fresh random routings from ``align_ref`` (ragged, skewed
with empty experts, every token on one expert, an expert-parallel shard whose
``token_to_row`` holds -1 for the non-local experts).  Every ``permute_quant``
case runs both ways: row-major (``row_to_token`` only) and token-major (given
``token_to_row`` too).  Acceptance on rows ``< expert_offsets[-1]``: codes
identical on >= 99.99% row-major (the kernel and the reference use the same f32
formula, so in practice 100%) and on 100% token-major, as the FP8 copy of
``permute``; scales bit-exact; padding rows zero codes and the scale of an
all-zero group; nothing left unwritten (outputs come from a poisoned
allocator).  Rows past ``expert_offsets[-1]`` are unspecified; a direct call on
pre-poisoned outputs checks the kernels never touch them.

T = 65536 runs for one routing (top-8 of 32 experts) and one H (4096: the codes buffer passes
2**31 bytes), not the whole cross product; the row-major kernels' grid-stride loop past 65535
row blocks runs on an M_cap of 65538 blocks at H = 128.  Their memory is stated there.
"""
import pytest
import torch

import cute_moe
from cute_moe.compiler import arch_of_device
from cute_moe.kernels import permute_quant as permute_quant_module
from cute_moe.kernels.moe_rows import MAX_GRID_Y, RowGroupKernel
from cute_moe.kernels.permute_quant import (
    TOKEN_SCALES_MIN_TOKENS,
    compile_permute,
    compile_permute_quant,
    compile_permute_quant_tokens,
    compile_scale_scatter,
    permute_cuda,
    permute_quant_cuda,
)
from cute_moe.reference import AMAX_FLOOR, FP8_MAX, align_ref, permute_quant_ref, permute_ref, quant_fp8_ref

from .gpu_helpers import code_match_fraction, random_activations
from .moe_cases import (
    ALIGNMENT,
    ROUTINGS,
    assert_past_end_untouched,
    assert_rows_match,
    poison_pools,
    poisoned_outputs,
    routed_maps,
    same_bits,
    topk_ids,
)

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 128, 4096]  # 4096: scales in two launches (TOKEN_SCALES_MIN_TOKENS); 0 and 65536 below
HIDDEN = [2048, 4096, 7168]
BIG_TOKENS, BIG_ROUTING, BIG_HIDDEN = 65536, "ragged", 4096  # M_cap = 528,384 rows
WAYS = ["row-major", "token-major"]


def _end(offsets: torch.Tensor) -> int:
    return int(offsets[-1])


def _maps(routing: str, num_tokens: int, seed: int):
    """(expert_offsets, row_to_token, token_to_row) of ``moe_cases.routed_maps``' routing."""
    num_experts, _, expert_offset, local = ROUTINGS[routing]
    ids = topk_ids(routing, num_tokens, seed)
    return align_ref(ids, num_experts, ALIGNMENT, expert_offset, local)[:3]


def _launch(way: str, x, row_to_token, offsets, scale_fmt, token_to_row):
    return permute_quant_cuda(x, row_to_token, offsets, scale_fmt, token_to_row if way == "token-major" else None)


def _check_quant(way, x, row_to_token, offsets, scale_fmt, token_to_row):
    m_cap, hidden = row_to_token.shape[0], x.shape[1]
    poison_pools(m_cap * hidden * 2 + (64 << 20))
    a, s = _launch(way, x, row_to_token, offsets, scale_fmt, token_to_row)
    want = permute_quant_ref(x, row_to_token, offsets, scale_fmt)
    assert_rows_match(a, s, *want, _end(offsets), exact_codes=way == "token-major")
    _assert_padding_zero(a, s, row_to_token, offsets, scale_fmt)
    return a, s


def _assert_padding_zero(a, s, row_to_token, offsets, scale_fmt):
    """Padding rows inside the segments: zero codes and the scale of an all-zero group."""
    pad = (row_to_token[: _end(offsets)] < 0).nonzero().flatten()
    if pad.numel():
        assert int(a.view(torch.uint8)[pad].max()) == 0
        zero_scale = s[pad]
        want = torch.full_like(zero_scale, AMAX_FLOOR) / torch.full_like(zero_scale, FP8_MAX)
        if scale_fmt == "ue8m0":
            want = torch.full_like(zero_scale, 2.0**-28)
        assert same_bits(zero_scale, want)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant(routing, num_tokens, hidden, scale_fmt, way):
    seed = 1000 * num_tokens + hidden + 7 * (scale_fmt is None) + list(ROUTINGS).index(routing)
    offsets, row_to_token, token_to_row = _maps(routing, num_tokens, seed)
    x = random_activations(num_tokens, hidden, torch.bfloat16, seed=seed)
    _check_quant(way, x, row_to_token, offsets, scale_fmt, token_to_row)


def _check_quant_by_blocks(way, x, row_to_token, offsets, token_to_row, block_rows: int = 1 << 16):
    """_check_quant for a large M_cap: the reference row block by row block (it holds several f32
    copies of its [rows, H] input), compared as assert_rows_match does: codes identical on >= 99.99%
    (all of them token-major), scales bit-exact, padding rows zeroed."""
    m_cap, hidden = row_to_token.shape[0], x.shape[1]
    poison_pools(m_cap * hidden * 2 + (64 << 20))
    a, s = _launch(way, x, row_to_token, offsets, None, token_to_row)
    assert a.shape == (m_cap, hidden) and a.dtype == torch.float8_e4m3fn
    assert s.shape == (m_cap, hidden // 128) and s.stride() == (1, m_cap)
    end, mismatches = _end(offsets), 0
    for lo in range(0, end, block_rows):
        hi = min(end, lo + block_rows)
        # rows [lo, hi) all lie before the end: the reference of the slice alone, ending at its last row
        a_ref, s_ref = permute_quant_ref(x, row_to_token[lo:hi], offsets.new_tensor([0, hi - lo]))
        mismatches += int((a[lo:hi].view(torch.uint8) != a_ref.view(torch.uint8)).sum())
        assert same_bits(s[lo:hi], s_ref), f"scales differ in rows [{lo}, {hi})"
        del a_ref, s_ref
    allowed = 0 if way == "token-major" else int(1e-4 * end * hidden)
    assert mismatches <= allowed, f"{mismatches} of {end * hidden} codes differ"
    _assert_padding_zero(a, s, row_to_token, offsets, None)


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_65536_tokens(way):
    """T = 65536 (issue 5's largest T) for one routing and H only: top-8 of 32 experts (16 K rows per
    expert, M_cap = 528,384) at H = 4096, so the codes buffer is 2.16 GB, past 2**31 bytes (64-bit
    row offsets); token-major takes the two-launch scale path.  GPU memory: x 0.5 GB, codes 2.2 GB,
    the poisoned block 4.3 GB, the reference by blocks of 65536 rows ~4 GB; peak ~11 GB, seconds."""
    offsets, row_to_token, token_to_row = _maps(BIG_ROUTING, BIG_TOKENS, seed=65536)
    assert row_to_token.shape[0] * BIG_HIDDEN > 2**31
    x = random_activations(BIG_TOKENS, BIG_HIDDEN, torch.bfloat16, seed=65536)
    _check_quant_by_blocks(way, x, row_to_token, offsets, token_to_row)


def _past_grid_y_maps(rows_per_cta: int, tokens: int, seed: int):
    """(M_cap, end, row_to_token, offsets) for the row-major kernels' grid-stride loop: M_cap of
    MAX_GRID_Y + 3 row blocks, one segment ending a block before M_cap (that block is past the
    end), rows naming ``tokens`` tokens at random (a token on many rows, as a row-major gather
    allows), ~1/8 of them padding (-1)."""
    m_cap = (MAX_GRID_Y + 3) * rows_per_cta
    end = m_cap - rows_per_cta
    g = torch.Generator(device="cuda").manual_seed(seed)
    row_to_token = torch.randint(0, tokens, (m_cap,), generator=g, device="cuda", dtype=torch.int32)
    row_to_token[torch.rand(m_cap, generator=g, device="cuda") < 0.125] = -1
    return m_cap, end, row_to_token, torch.tensor([0, end], dtype=torch.int32, device="cuda")


def test_permute_quant_more_than_65535_row_blocks():
    """Row-major, M_cap of MAX_GRID_Y + 3 blocks of 64 rows (4.19 M rows at H = 128): the grid's
    65535 row blocks stride over the last 3, the last one past the end (untouched).  Rows name
    65536 tokens at random (a token on many rows, as a row-major gather allows) with ~1/8 of them
    padding.  Outputs pre-poisoned (a direct call).  GPU memory: codes 0.54 GB, the reference's f32
    copies of [M_cap, 128] 2.1 GB each, peak ~9 GB; about a second."""
    hidden, tokens = 128, 65536
    m_cap, end, row_to_token, offsets = _past_grid_y_maps(RowGroupKernel(2).rows_per_cta, tokens, seed=47)
    x = random_activations(tokens, hidden, torch.bfloat16, seed=47)
    a, s = poisoned_outputs(m_cap, hidden)
    compile_permute_quant(torch.bfloat16, False, arch_of_device(x.device))(x, row_to_token, offsets, a, s)
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets, None), end)
    _assert_padding_zero(a, s, row_to_token, offsets, None)
    assert_past_end_untouched(a, s, end)


def test_tokens_cover_both_scale_paths():
    assert min(TOKENS) < TOKEN_SCALES_MIN_TOKENS <= max(TOKENS)


def test_maps_match_moe_cases():
    """_maps is routed_maps plus token_to_row: the row-major cases are the ones they always were."""
    offsets, row_to_token, _ = _maps("skewed", 300, seed=3)
    want_offsets, want_map = routed_maps("skewed", 300, seed=3)
    assert torch.equal(offsets, want_offsets) and torch.equal(row_to_token, want_map)


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_fp16_and_strided_rows(way):
    offsets, row_to_token, token_to_row = _maps("ragged", 300, seed=11)
    base = random_activations(300, 4096 + 256, torch.float16, seed=11)
    _check_quant(way, base[:, :4096], row_to_token, offsets, None, token_to_row)


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_h_not_a_multiple_of_1024(way):
    """H = 13 * 128: the token-major kernel's last zeroing slab holds 5 of its 8 group columns."""
    offsets, row_to_token, token_to_row = _maps("skewed", 200, seed=19)
    x = random_activations(200, 13 * 128, torch.bfloat16, seed=19)
    _check_quant(way, x, row_to_token, offsets, "ue8m0", token_to_row)


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_negative_zero_inputs(way):
    """x = -0.0 quantizes to code 0x80, as the reference's true division (the shared quantizer's
    FMA residual step alone would give +0)."""
    offsets, row_to_token, token_to_row = _maps("ragged", 64, seed=12)
    x = random_activations(64, 2048, torch.bfloat16, seed=12)
    x[:, ::3] = -0.0
    a, _ = _check_quant(way, x, row_to_token, offsets, None, token_to_row)
    rows = (row_to_token[: _end(offsets)] >= 0).nonzero().flatten()
    assert bool((a.view(torch.uint8)[rows][:, ::3] == 0x80).all())


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant_rows_past_end_untouched(way, scale_fmt):
    offsets, row_to_token, token_to_row = _maps("ep_shard", 128, seed=13)
    x = random_activations(128, 2048, torch.bfloat16, seed=13)
    a, s = poisoned_outputs(row_to_token.shape[0], 2048)
    ue8m0, arch = scale_fmt == "ue8m0", arch_of_device(x.device)
    if way == "token-major":
        compile_permute_quant_tokens(torch.bfloat16, ue8m0, token_to_row.shape[1], arch)(
            x, token_to_row, row_to_token, offsets, a, s, s
        )
    else:
        compile_permute_quant(torch.bfloat16, ue8m0, arch)(x, row_to_token, offsets, a, s)
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets, scale_fmt), _end(offsets), exact_codes=True)
    _assert_padding_zero(a, s, row_to_token, offsets, scale_fmt)
    assert_past_end_untouched(a, s, _end(offsets))


@pytest.mark.parametrize("routing", ["ragged", "ep_shard"])
@pytest.mark.parametrize("num_tokens", [1, 128])
def test_permute_quant_token_major_without_zeroing(routing, num_tokens):
    """zero_padding=False (what fused_moe passes): routed rows as the reference, padding rows and
    rows past the end never written (still the poison of a direct call)."""
    offsets, row_to_token, token_to_row = _maps(routing, num_tokens, seed=31 + num_tokens)
    x = random_activations(num_tokens, 2048, torch.bfloat16, seed=31 + num_tokens)
    a, s = poisoned_outputs(row_to_token.shape[0], 2048)
    compile_permute_quant_tokens(torch.bfloat16, False, token_to_row.shape[1], arch_of_device(x.device), False,
                                 False)(x, token_to_row, row_to_token, offsets, a, s, s)  # fmt: skip
    _assert_routed_rows_only(x, a, s, row_to_token, offsets)


def _assert_routed_rows_only(x, a, s, row_to_token, offsets):
    a = a.view(torch.float8_e4m3fn)
    end = _end(offsets)
    routed = (row_to_token[:end] >= 0).nonzero().flatten()
    pad = (row_to_token[:end] < 0).nonzero().flatten()
    assert routed.numel() and pad.numel()
    a_ref, s_ref = permute_quant_ref(x, row_to_token, offsets, None)
    assert torch.equal(a[routed].view(torch.uint8), a_ref[routed].view(torch.uint8))
    assert same_bits(s[routed], s_ref[routed])
    assert bool((a[pad].view(torch.uint8) == 0xFF).all()) and bool(s[pad].isnan().all())
    if end < a.shape[0]:  # T=1 over 8 experts fills M_cap = 8 + 8 * 127 exactly
        assert_past_end_untouched(a, s, end)


@pytest.mark.parametrize("zero_padding", [True, False])
@pytest.mark.parametrize("routing", ["ragged", "ep_shard"])
def test_permute_quant_token_scales_in_two_launches(routing, zero_padding):
    """The path of large T (from TOKEN_SCALES_MIN_TOKENS on), forced at T=128: scales once per token
    into token_scale, then ScaleScatterKernel to the rows.  Same outputs as the one-launch kernel;
    padding rows zeroed or never written, rows past the end untouched."""
    offsets, row_to_token, token_to_row = _maps(routing, 128, seed=41)
    x = random_activations(128, 7168, torch.bfloat16, seed=41)
    a, s = poisoned_outputs(row_to_token.shape[0], 7168)
    token_scale = torch.full((128, 7168 // 128), float("nan"), device="cuda")
    arch = arch_of_device(x.device)
    compile_permute_quant_tokens(torch.bfloat16, False, token_to_row.shape[1], arch, False, zero_padding, True)(
        x, token_to_row, row_to_token, offsets, a, s, token_scale
    )
    compile_scale_scatter(arch, False, zero_padding)(token_scale, row_to_token, offsets, s)
    if not zero_padding:
        _assert_routed_rows_only(x, a, s, row_to_token, offsets)
        return
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets, None), _end(offsets), exact_codes=True)
    _assert_padding_zero(a, s, row_to_token, offsets, None)
    assert_past_end_untouched(a, s, _end(offsets))


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("hidden", [3584, 7168])
def test_permute_quant_two_launches_through_the_launch_function(monkeypatch, hidden, scale_fmt):
    """The two-launch path as permute_quant_cuda takes it, forced at T=128 (TOKEN_SCALES_MIN_TOKENS
    lowered): its token-scale scratch has H / 128 groups rounded up to 8 columns (H = 3584: 28 of
    32, the scatter's last tile partial and 4 columns never written), padding rows zeroed with the
    format's all-zero scale."""
    monkeypatch.setattr(permute_quant_module, "TOKEN_SCALES_MIN_TOKENS", 1)
    offsets, row_to_token, token_to_row = _maps("ragged", 128, seed=43)
    x = random_activations(128, hidden, torch.bfloat16, seed=43)
    _check_quant("token-major", x, row_to_token, offsets, scale_fmt, token_to_row)


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_no_tokens(way):
    x = torch.empty(0, 2048, dtype=torch.bfloat16, device="cuda")
    offsets, row_to_token, token_to_row = _maps("ragged", 0, seed=14)
    a, s = _launch(way, x, row_to_token, offsets, None, token_to_row)
    assert a.shape == (0, 2048) and s.shape == (0, 16)
    # Every row padding (T = 0 with a non-empty segment): still written, from zeros.
    row_to_token = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 128, 128], dtype=torch.int32, device="cuda")
    _check_quant(way, x, row_to_token, offsets, "ue8m0", torch.empty(0, 8, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_cuda_graph_new_routing(way):
    """The kernels read expert_offsets[-1] (and the maps) on the device: a captured graph follows
    new routings."""
    offsets, row_to_token, token_to_row = _maps("skewed", 512, seed=15)
    x = random_activations(512, 7168, torch.bfloat16, seed=15)
    _launch(way, x, row_to_token, offsets, None, token_to_row)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, s = _launch(way, x, row_to_token, offsets, None, token_to_row)
    for seed in (16, 17):
        new_offsets, new_map, new_t2r = _maps("skewed", 512, seed=seed)
        assert new_map.shape == row_to_token.shape
        offsets.copy_(new_offsets)
        row_to_token.copy_(new_map)
        token_to_row.copy_(new_t2r)
        x.copy_(random_activations(512, 7168, torch.bfloat16, seed=seed))
        a.view(torch.uint8).fill_(0xFF)
        s.fill_(float("nan"))
        graph.replay()
        a_ref, s_ref = permute_quant_ref(x, row_to_token, offsets)
        end = _end(offsets)
        assert code_match_fraction(a[:end], a_ref[:end]) == 1.0 and same_bits(s[:end], s_ref[:end])


@pytest.mark.parametrize("way", WAYS)
def test_permute_quant_rejects_misaligned_rows(way):
    offsets, row_to_token, token_to_row = _maps("ragged", 8, seed=18)
    x = random_activations(8, 2048 + 8, torch.bfloat16, seed=18)[:, 4 : 4 + 2048]
    with pytest.raises(ValueError, match="x"):
        _launch(way, x, row_to_token, offsets, None, token_to_row)


# ----------------------------------------------------------------------------- token-major only


def _random_maps(num_tokens: int, k: int, num_experts: int, seed: int, expert_offset: int = 0, local=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g, device="cuda")
    ids = scores.argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    return align_ref(ids, num_experts, ALIGNMENT, expert_offset, local)[:3]


@pytest.mark.parametrize("k", [1, 2, 16, 17, 20, 32, 40])
def test_permute_quant_token_major_top_k(k):
    """Every k the token-major kernel compiles for (k > 16: two token_to_row entries per lane), and
    k = 40, which goes to the row-major kernel."""
    offsets, row_to_token, token_to_row = _random_maps(300, k, 64, seed=30 + k)
    x = random_activations(300, 2048, torch.bfloat16, seed=30 + k)
    _check_quant("token-major", x, row_to_token, offsets, None, token_to_row)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant_token_major_expert_parallel(scale_fmt):
    """EP: local experts [24, 40) of 64; many token_to_row entries are -1, some tokens have no local
    expert at all; through the op with an int64 token_to_row (narrowed on the host)."""
    offsets, row_to_token, token_to_row = _random_maps(1000, 6, 64, seed=40, expert_offset=24, local=16)
    assert bool((token_to_row == -1).all(dim=1).any()) and bool((token_to_row >= 0).any())
    x = random_activations(1000, 7168, torch.bfloat16, seed=41)
    poison_pools(row_to_token.shape[0] * 7168 * 2 + (64 << 20))
    a, s = torch.ops.cute_moe.permute_quant(x, row_to_token, offsets, scale_fmt, token_to_row.long())
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets, scale_fmt), _end(offsets), exact_codes=True)
    _assert_padding_zero(a, s, row_to_token, offsets, scale_fmt)


def test_permute_quant_int64_token_to_row_past_int32_is_skipped():
    """An int64 token_to_row entry outside int32 is not local, like -1: the host's narrowing must
    not wrap it onto a row.  Entry (7, 3) becomes 2**32 + its own row, which row_to_token now calls
    padding (the maps stay each other's inverse); without zeroing nothing else writes that row, so a
    wrapped entry would leave token 7's codes there."""
    offsets, row_to_token, token_to_row = _random_maps(600, 8, 64, seed=44)
    x = random_activations(600, 2048, torch.bfloat16, seed=45)
    t2r = token_to_row.long()
    own = int(t2r[7, 3])
    t2r[7, 3] = (1 << 32) + own
    r2t = row_to_token.clone()
    r2t[own] = -1
    poison_pools(r2t.shape[0] * 2048 * 2 + (64 << 20))
    a, s = torch.ops.cute_moe.permute_quant(x, r2t, offsets, None, t2r, False)
    a_ref, s_ref = permute_quant_ref(x, r2t, offsets, None)
    real = (r2t >= 0).nonzero().flatten()  # padding rows are unspecified without zeroing
    assert torch.equal(a[real].view(torch.uint8), a_ref[real].view(torch.uint8))
    assert same_bits(s[real], s_ref[real])
    token_7_codes = permute_quant_ref(x, row_to_token, offsets, None)[0][own]
    assert not torch.equal(a[own].view(torch.uint8), token_7_codes.view(torch.uint8))


def test_debug_index_checks(monkeypatch):
    """CUTE_MOE_DEBUG=1: the CUDA paths check index data as the CPU ones do (named ValueErrors), e.g.
    vLLM's sorted_token_ids (flattened t*k+j, padded with T*k) passed as row_to_token."""
    offsets, row_to_token, token_to_row = _maps("ragged", 16, seed=50)
    x = random_activations(16, 2048, torch.bfloat16, seed=50)
    bad_t2r = token_to_row.clone()
    bad_t2r[3, 1] = row_to_token.shape[0]
    bad_r2t = row_to_token.clone()
    bad_r2t[row_to_token == -1] = 16 * token_to_row.shape[1]
    bad_offsets = offsets.flip(0).contiguous()  # in [0, M_cap], decreasing
    monkeypatch.setenv("CUTE_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match=r"permute_quant: token_to_row entries must lie in \[-1, "):
        cute_moe.permute_quant(x, row_to_token, offsets, token_to_row=bad_t2r)
    for t2r in (None, token_to_row):
        with pytest.raises(ValueError, match=r"permute_quant: row_to_token entries must lie in \[-1, 16\)"):
            cute_moe.permute_quant(x, bad_r2t, offsets, token_to_row=t2r)
    with pytest.raises(ValueError, match=r"permute_quant: expert_offsets must be non-decreasing"):
        cute_moe.permute_quant(x, row_to_token, bad_offsets)
    a_in, s_in = cute_moe.quant_fp8(x)
    with pytest.raises(ValueError, match=r"permute: row_to_token entries must lie in \[-1, 16\)"):
        cute_moe.permute(a_in, s_in, bad_r2t, offsets)
    a, a_scale = cute_moe.permute_quant(x, row_to_token, offsets)
    b = a_in.new_zeros(offsets.shape[0] - 1, 256, 2048)
    b_scale = torch.ones(offsets.shape[0] - 1, 2, 16, device=x.device)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: expert_offsets must be non-decreasing"):
        cute_moe.grouped_gemm_fp8(a, a_scale, b, b_scale, bad_offsets)
    misaligned = torch.full_like(offsets, 64)
    misaligned[0] = 0
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8: expert_offsets must be multiples of 128 on the GPU"):
        cute_moe.grouped_gemm_fp8(a, a_scale, b, b_scale, misaligned)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8_swiglu: expert_offsets must be multiples of 128 on the GPU"):
        cute_moe.grouped_gemm_fp8_swiglu(a, a_scale, b, b_scale, misaligned)
    counts = (offsets[1:] - offsets[:-1]) + 1
    with pytest.raises(ValueError, match=r"silu_mul_quant: expert_counts\[e\] must lie in"):
        cute_moe.silu_mul_quant(torch.zeros(a.shape[0], 256, dtype=torch.bfloat16, device=x.device), offsets,
                                expert_counts=counts.to(torch.int32))  # fmt: skip


# ----------------------------------------------------------------------------- permute (FP8 in)


def _check_permute(a_in, a_in_scale, row_to_token, offsets):
    m_cap, hidden = row_to_token.shape[0], a_in.shape[1]
    poison_pools(m_cap * hidden + m_cap * (hidden // 128) * 4 + (64 << 20))  # room for codes and scales
    a, s = permute_cuda(a_in, a_in_scale, row_to_token, offsets)
    assert_rows_match(a, s, *permute_ref(a_in, a_in_scale, row_to_token, offsets), _end(offsets), exact_codes=True)


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("column_major", [False, True])
def test_permute(routing, num_tokens, hidden, column_major):
    seed = 2000 * num_tokens + hidden + column_major + 3 * list(ROUTINGS).index(routing)
    offsets, row_to_token = routed_maps(routing, num_tokens, seed)
    x = random_activations(num_tokens, hidden, torch.bfloat16, seed=seed)
    a_in, a_in_scale = quant_fp8_ref(x, 128, None, column_major)
    _check_permute(a_in, a_in_scale, row_to_token, offsets)


@pytest.mark.parametrize("column_major", [False, True])
def test_permute_65536_tokens(column_major):
    """T = 65536 for one routing and H only (as test_permute_quant_65536_tokens): M_cap = 528,384
    rows of 4096 codes, 2.16 GB, past 2**31 bytes.  GPU memory: the poisoned block 2.2 GB (the codes
    out are allocated in it), the reference's gathered copy 2.2 GB, x's f32 draw 1.1 GB (transient);
    peak ~6 GB, seconds."""
    offsets, row_to_token = routed_maps(BIG_ROUTING, BIG_TOKENS, seed=65537 + column_major)
    x = random_activations(BIG_TOKENS, BIG_HIDDEN, torch.bfloat16, seed=65537 + column_major)
    a_in, a_in_scale = quant_fp8_ref(x, 128, None, column_major)
    del x
    _check_permute(a_in, a_in_scale, row_to_token, offsets)


def test_permute_more_than_65535_row_blocks():
    """Row-major FP8 gather, M_cap of MAX_GRID_Y + 3 blocks of 128 rows (8.39 M rows at H = 128):
    the grid-stride loop covers the last 3 blocks, the last one past the end (untouched); rows name
    65536 tokens at random, ~1/8 padding (codes 0, scale 1.0).  Outputs pre-poisoned (a direct
    call).  GPU memory: codes 1.07 GB, the reference's gathered copy 1.07 GB; peak ~3 GB."""
    hidden, tokens = 128, 65536
    m_cap, end, row_to_token, offsets = _past_grid_y_maps(RowGroupKernel(1).rows_per_cta, tokens, seed=48)
    a_in, a_in_scale = quant_fp8_ref(random_activations(tokens, hidden, torch.bfloat16, seed=48))
    a, s = poisoned_outputs(m_cap, hidden)
    compile_permute(arch_of_device(a_in.device))(a_in.view(torch.uint8), a_in_scale, row_to_token, offsets, a, s)
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_ref(a_in, a_in_scale, row_to_token, offsets), end, exact_codes=True)
    assert_past_end_untouched(a, s, end)


def test_permute_rows_past_end_untouched_and_no_tokens():
    offsets, row_to_token = routed_maps("ep_shard", 128, seed=21)
    a_in, a_in_scale = quant_fp8_ref(random_activations(128, 2048, torch.bfloat16, seed=21))
    a, s = poisoned_outputs(row_to_token.shape[0], 2048)
    compile_permute(arch_of_device(a_in.device))(a_in.view(torch.uint8), a_in_scale, row_to_token, offsets, a, s)
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_ref(a_in, a_in_scale, row_to_token, offsets), _end(offsets), exact_codes=True)
    assert_past_end_untouched(a, s, _end(offsets))
    empty = torch.empty(0, 2048, dtype=torch.float8_e4m3fn, device="cuda")
    row_to_token = torch.full((128,), -1, dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    _check_permute(empty, torch.empty(0, 16, device="cuda"), row_to_token, offsets)
