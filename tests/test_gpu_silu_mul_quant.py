"""silu_mul_quant's CuTe DSL kernel against the reference, on the GPU.

``silu_mul_quant_cuda`` is called directly on h of fresh random data (magnitudes
over six decades, so gates below -87.3 -- where the kernel returns a signed
zero for silu instead of a value under 1.1e-36 -- are common) and routings from
``align_ref``.  Acceptance on rows ``< expert_offsets[-1]``: codes identical on
>= 99.99% (the kernel mirrors torch's f32 silu bit for bit elsewhere; its
quotient ``y * (1/scale)`` moves about one code in a million to the neighbouring
e4m3 value), scales bit-exact, nothing left unwritten (poisoned allocator);
rows past ``expert_offsets[-1]`` are never touched.

With ``expert_counts`` (align's fourth output) only the real rows
``[off[e], off[e] + counts[e])`` are specified: they get the same acceptance
against the reference and must be bit for bit what the kernel writes without
counts; the padding rows, poisoned before, may stay poisoned (and do, for
segments of multiples of 128 rows: the kernel neither reads nor writes them).
"""
import pytest
import torch

from cute_moe.compiler import arch_of_device
from cute_moe.kernels.moe_rows import MAX_GRID_Y
from cute_moe.kernels.silu_mul_quant import compile_silu_mul_quant, silu_mul_quant_cuda
from cute_moe.reference import align_ref, silu_mul_quant_ref

from .gpu_helpers import code_match_fraction, random_activations
from .moe_cases import (
    ROUTINGS,
    assert_past_end_untouched,
    assert_rows_match,
    padding_rows,
    poison_pools,
    poisoned_outputs,
    real_rows,
    routed_maps,
    routed_maps_with_counts,
    same_bits,
)

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 128, 4096]
WIDTHS = [2048, 7168]  # 2I


def _check(h, offsets, gate_first, scale_fmt, counts=None):
    m_cap, inter = h.shape[0], h.shape[1] // 2
    poison_pools(m_cap * inter + (64 << 20))
    a2, s = silu_mul_quant_cuda(h, offsets, gate_first, scale_fmt, counts)
    a2_ref, s_ref = silu_mul_quant_ref(h, offsets, gate_first, scale_fmt)
    if counts is None:
        assert_rows_match(a2, s, a2_ref, s_ref, min(int(offsets[-1]), m_cap))
    else:
        _check_real_rows(h, offsets, gate_first, scale_fmt, counts, a2, s, a2_ref, s_ref)
    return a2, s


def _check_real_rows(h, offsets, gate_first, scale_fmt, counts, a2, s, a2_ref, s_ref):
    """With counts: the real rows against the reference, and bit for bit against the kernel's own
    output without counts (counts choose rows, never change a value); padding rows not looked at."""
    m_cap, inter = a2_ref.shape
    assert a2.shape == (m_cap, inter) and a2.dtype == torch.float8_e4m3fn
    assert s.shape == (m_cap, inter // 128) and s.stride() == (1, m_cap) and s.dtype == torch.float32
    rows = real_rows(offsets, counts)
    codes, scales = a2.view(torch.uint8)[rows], s[rows]
    assert code_match_fraction(codes, a2_ref.view(torch.uint8)[rows]) >= 0.9999
    assert same_bits(scales, s_ref[rows]), (scales - s_ref[rows]).abs().max()
    a2_all, s_all = silu_mul_quant_cuda(h, offsets, gate_first, scale_fmt)
    assert torch.equal(codes, a2_all.view(torch.uint8)[rows]) and same_bits(scales, s_all[rows])


@pytest.mark.parametrize("with_counts", [False, True])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_silu_mul_quant(routing, num_tokens, width, gate_first, scale_fmt, with_counts):
    seed = 3000 * num_tokens + width + 2 * gate_first + (scale_fmt is None) + 5 * list(ROUTINGS).index(routing)
    offsets, row_to_token, counts = routed_maps_with_counts(routing, num_tokens, seed)
    h = random_activations(row_to_token.shape[0], width, torch.bfloat16, seed=seed)
    _check(h, offsets, gate_first, scale_fmt, counts if with_counts else None)


def _special_halves():
    """(gate, up) [16, 128] float32: gate values at the edges of the f32 silu -- signed zeros,
    subnormals, tiny and huge values, the d > 2**126 boundary near -87.34, the expf overflow
    near -88.72 -- against four up values (no product overflows f32)."""
    gates = [0.0, -0.0, 1e-40, -1e-40, 2.0**-30, -(2.0**-30), 2.0**-25, -(2.0**-24), 1e-3, -1e-3,
             1.0, -1.0, 16.0, -16.0, 17.0, -17.0, 80.0, -80.0, -87.0, -87.25, -87.3, -87.34, -87.4,
             -87.5, -88.0, -88.5, -88.7, -88.75, -89.0, -100.0, -1000.0, -3e38, 100.0, 1e30]
    g = torch.tensor(gates).repeat(4 * 128 // len(gates) + 1)[: 4 * 128].reshape(4, 128)
    ups = [1.0, -1.0, 1000.0, -1e-3]
    return g.repeat(len(ups), 1), torch.cat([torch.full_like(g, u) for u in ups])


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_silu_special_values(scale_fmt):
    """Groups made only of special values (their scale comes from them) and groups half special,
    half ordinary; every code and scale of those must equal the reference's (their amax, 1e30 *
    |up|, sends every other quotient to a zero code).  The ordinary groups beside them get the
    usual acceptance."""
    sg, su = _special_halves()
    og, ou = (t.float().cpu() for t in random_activations(16, 256, torch.bfloat16, seed=31).split(128, dim=1))
    pure = torch.cat([sg, og, su, ou], dim=1)  # I = 256: group 0 special, group 1 ordinary
    mixed = torch.cat([sg[:, :64], og[:, :64], og[:, 64:], sg[:, 64:],
                       su[:, :64], ou[:, :64], ou[:, 64:], su[:, 64:]], dim=1)
    h = torch.cat([pure, mixed]).to(torch.bfloat16).cuda()
    offsets = torch.tensor([0, h.shape[0]], dtype=torch.int32, device="cuda")
    a2, _ = _check(h, offsets, True, scale_fmt)
    a2_ref, _ = silu_mul_quant_ref(h, offsets, True, scale_fmt)
    codes, ref = a2.view(torch.uint8), a2_ref.view(torch.uint8)
    special = len(pure)  # rows [0, 16): group 0 special, group 1 ordinary; rows [16, 32): mixed
    assert torch.equal(codes[:special, :128], ref[:special, :128]) and torch.equal(codes[special:], ref[special:])


def test_silu_rows_past_end_untouched():
    offsets, row_to_token = routed_maps("ep_shard", 128, seed=41)
    m_cap = row_to_token.shape[0]
    h = random_activations(m_cap, 4096, torch.bfloat16, seed=41)
    a2, s = poisoned_outputs(m_cap, 2048)
    fn = compile_silu_mul_quant(torch.bfloat16, False, arch_of_device(h.device))
    fn(h[:, :2048], h[:, 2048:], offsets, offsets, a2, s)  # (expert_counts slot unused: offsets)
    a2 = a2.view(torch.float8_e4m3fn)
    assert_rows_match(a2, s, *silu_mul_quant_ref(h, offsets, True), int(offsets[-1]))
    assert_past_end_untouched(a2, s, int(offsets[-1]))


@pytest.mark.parametrize(("routing", "num_tokens"), [("skewed", 1), ("skewed", 128), ("skewed", 4096),
                                                    ("ep_shard", 128), ("ep_shard", 4096)])  # fmt: skip
def test_silu_counts_skip_padding(routing, num_tokens):
    """With counts and segments of multiples of 128 rows, the kernel writes no padding row (and
    none past the end): what the traffic saving rests on.  The contract only leaves them
    unspecified; this pins the implementation."""
    offsets, row_to_token, counts = routed_maps_with_counts(routing, num_tokens, seed=48 + num_tokens)
    m_cap = row_to_token.shape[0]
    h = random_activations(m_cap, 4096, torch.bfloat16, seed=49)
    a2, s = poisoned_outputs(m_cap, 2048)
    fn = compile_silu_mul_quant(torch.bfloat16, False, arch_of_device(h.device), False, True)
    fn(h[:, :2048], h[:, 2048:], offsets, counts, a2, s)
    a2 = a2.view(torch.float8_e4m3fn)
    _check_real_rows(h, offsets, True, None, counts, a2, s, *silu_mul_quant_ref(h, offsets, True))
    pad = padding_rows(offsets, counts)
    assert pad.numel() > 0
    assert bool((a2.view(torch.uint8)[pad] == 0xFF).all()) and bool(s[pad].isnan().all())
    end = int(offsets[-1])
    if end < m_cap:
        assert_past_end_untouched(a2, s, end)


@pytest.mark.parametrize("alignment", [1, 8, 64])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_silu_counts_other_alignments(alignment, scale_fmt):
    """Segments aligned to fewer rows than the GEMM needs: a 64-row block may straddle segment
    ends and is then processed whole; the real rows are right whatever the alignment."""
    offsets, row_to_token, counts = routed_maps_with_counts("ragged", 300, seed=50 + alignment, alignment=alignment)
    h = random_activations(row_to_token.shape[0], 2048, torch.bfloat16, seed=51)
    _check(h, offsets, True, scale_fmt, counts)


@pytest.mark.parametrize("num_experts", [256, 257, 600])
def test_silu_counts_many_experts(num_experts):
    """The per-warp segment lookup takes 256 segments per round of loads: one round, one segment
    more, three rounds (experts past 256 are found in the later rounds)."""
    g = torch.Generator(device="cuda").manual_seed(52)
    ids = torch.rand(512, num_experts, generator=g, device="cuda").argsort(dim=1)[:, :8].to(torch.int32)
    offsets, row_to_token, _, counts = align_ref(ids, num_experts, 128)
    h = random_activations(row_to_token.shape[0], 1024, torch.bfloat16, seed=53)
    _check(h, offsets, True, None, counts)


@pytest.mark.parametrize("with_counts", [False, True])
def test_silu_no_rows_and_strided_h(with_counts):
    counts = torch.zeros(2, dtype=torch.int32, device="cuda") if with_counts else None
    a2, s = silu_mul_quant_cuda(torch.empty(0, 512, dtype=torch.bfloat16, device="cuda"),
                                torch.zeros(3, dtype=torch.int32, device="cuda"), True, None, counts)
    assert a2.shape == (0, 256) and s.shape == (0, 2)
    base = random_activations(200, 1024 + 256, torch.bfloat16, seed=42)
    offsets = torch.tensor([0, 128, 128, 192], dtype=torch.int32, device="cuda")
    counts = torch.tensor([100, 0, 37], dtype=torch.int32, device="cuda") if with_counts else None
    _check(base[:, :1024], offsets, False, "ue8m0", counts)


@pytest.mark.parametrize("with_counts", [False, True])
def test_silu_fp16(with_counts):
    offsets, row_to_token, counts = routed_maps_with_counts("ragged", 64, seed=43)
    h = random_activations(row_to_token.shape[0], 2048, torch.float16, seed=43)
    _check(h, offsets, True, None, counts if with_counts else None)


@pytest.mark.parametrize("with_counts", [False, True])
def test_silu_more_than_65535_row_blocks(with_counts):
    """M_cap of 65538 blocks of 64 rows: the grid's third dimension covers the last 3 blocks (the
    last one past end; with counts, 36 padding rows in the one before)."""
    inter, m_cap = 128, (MAX_GRID_Y + 3) * 64
    h = random_activations(m_cap, 2 * inter, torch.bfloat16, seed=44)
    offsets = torch.tensor([0, m_cap - 64], dtype=torch.int32, device="cuda")
    counts = torch.tensor([m_cap - 100], dtype=torch.int32, device="cuda") if with_counts else None
    _check(h, offsets, True, None, counts)


@pytest.mark.parametrize("with_counts", [False, True])
def test_silu_cuda_graph_new_offsets(with_counts):
    """expert_offsets (and expert_counts) are read on the device: a captured graph follows new routings."""
    offsets, row_to_token, counts = routed_maps_with_counts("skewed", 256, seed=44)
    counts = counts if with_counts else None
    h = random_activations(row_to_token.shape[0], 4096, torch.bfloat16, seed=44)
    silu_mul_quant_cuda(h, offsets, True, None, counts)  # compile before capture
    silu_mul_quant_cuda(h, offsets, True, None)  # (the reference run of _check_real_rows too)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a2, s = silu_mul_quant_cuda(h, offsets, True, None, counts)
    for seed in (45, 46):
        new_offsets, _, new_counts = routed_maps_with_counts("skewed", 256, seed=seed)
        offsets.copy_(new_offsets)
        if counts is not None:
            counts.copy_(new_counts)
        h.copy_(random_activations(h.shape[0], 4096, torch.bfloat16, seed=seed))
        a2.view(torch.uint8).fill_(0xFF)
        s.fill_(float("nan"))
        graph.replay()
        a2_ref, s_ref = silu_mul_quant_ref(h, offsets, True)
        if counts is None:
            end = int(offsets[-1])
            assert code_match_fraction(a2[:end], a2_ref[:end]) >= 0.9999 and same_bits(s[:end], s_ref[:end])
        else:
            _check_real_rows(h, offsets, True, None, counts, a2, s, a2_ref, s_ref)


def test_silu_rejects_misaligned_rows():
    h = random_activations(8, 512 + 8, torch.bfloat16, seed=47)[:, 4 : 4 + 512]
    with pytest.raises(ValueError, match="h"):
        silu_mul_quant_cuda(h, torch.tensor([0, 8], dtype=torch.int32, device="cuda"), True, None)
