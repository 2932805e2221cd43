"""permute_quant's and permute's CuTe DSL kernels against the references, on the GPU.

The kernels' launch functions are called directly (``permute_quant_cuda``,
``permute_cuda``) on fresh random routings from ``align_ref`` (ragged, skewed
with empty experts, every token on one expert, an expert-parallel shard).
Acceptance on rows ``< expert_offsets[-1]``: codes identical on >= 99.99% (the
kernel and the reference use the same f32 formula, so in practice 100%; the
FP8 copy of ``permute`` exactly), scales bit-exact, nothing left unwritten
(outputs come from a poisoned allocator).  Rows past ``expert_offsets[-1]`` are
unspecified; a direct call on pre-poisoned outputs checks the kernels never
touch them.
"""
import pytest
import torch

from cute_moe.compiler import arch_of_device
from cute_moe.kernels.permute_quant import compile_permute, compile_permute_quant, permute_cuda, permute_quant_cuda
from cute_moe.reference import AMAX_FLOOR, FP8_MAX, permute_quant_ref, permute_ref, quant_fp8_ref

from .gpu_helpers import code_match_fraction, random_activations
from .moe_cases import (
    ROUTINGS,
    assert_past_end_untouched,
    assert_rows_match,
    poison_pools,
    poisoned_outputs,
    routed_maps,
    same_bits,
)

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 128, 4096]
HIDDEN = [2048, 7168]


def _end(offsets: torch.Tensor) -> int:
    return int(offsets[-1])


def _check_quant(x, row_to_token, offsets, scale_fmt):
    m_cap, hidden = row_to_token.shape[0], x.shape[1]
    poison_pools(m_cap * hidden * 2 + (64 << 20))
    a, s = permute_quant_cuda(x, row_to_token, offsets, scale_fmt)
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets, scale_fmt), _end(offsets))
    return a, s


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant(routing, num_tokens, hidden, scale_fmt):
    seed = 1000 * num_tokens + hidden + 7 * (scale_fmt is None) + list(ROUTINGS).index(routing)
    offsets, row_to_token = routed_maps(routing, num_tokens, seed)
    x = random_activations(num_tokens, hidden, torch.bfloat16, seed=seed)
    a, s = _check_quant(x, row_to_token, offsets, scale_fmt)
    # Padding rows inside the segments: zero codes and the scale of an all-zero group.
    pad = (row_to_token[: _end(offsets)] < 0).nonzero().flatten()
    if pad.numel():
        assert int(a.view(torch.uint8)[pad].max()) == 0
        zero_scale = s[pad]
        want = torch.full_like(zero_scale, AMAX_FLOOR) / torch.full_like(zero_scale, FP8_MAX)
        if scale_fmt == "ue8m0":
            want = torch.full_like(zero_scale, 2.0**-28)
        assert same_bits(zero_scale, want)


def test_permute_quant_fp16_and_strided_rows():
    offsets, row_to_token = routed_maps("ragged", 300, seed=11)
    base = random_activations(300, 4096 + 256, torch.float16, seed=11)
    _check_quant(base[:, :4096], row_to_token, offsets, None)


def test_permute_quant_negative_zero_inputs():
    """x = -0.0 quantizes to code 0x80, as the reference's true division (the shared quantizer's
    FMA residual step alone would give +0)."""
    offsets, row_to_token = routed_maps("ragged", 64, seed=12)
    x = random_activations(64, 2048, torch.bfloat16, seed=12)
    x[:, ::3] = -0.0
    a, _ = _check_quant(x, row_to_token, offsets, None)
    rows = (row_to_token[: _end(offsets)] >= 0).nonzero().flatten()
    assert bool((a.view(torch.uint8)[rows][:, ::3] == 0x80).all())


def test_permute_quant_rows_past_end_untouched():
    offsets, row_to_token = routed_maps("ep_shard", 128, seed=13)
    x = random_activations(128, 2048, torch.bfloat16, seed=13)
    a, s = poisoned_outputs(row_to_token.shape[0], 2048)
    compile_permute_quant(torch.bfloat16, False, arch_of_device(x.device))(x, row_to_token, offsets, a, s)
    a = a.view(torch.float8_e4m3fn)
    assert_rows_match(a, s, *permute_quant_ref(x, row_to_token, offsets), _end(offsets), exact_codes=True)
    assert_past_end_untouched(a, s, _end(offsets))


def test_permute_quant_no_tokens():
    x = torch.empty(0, 2048, dtype=torch.bfloat16, device="cuda")
    offsets, row_to_token = routed_maps("ragged", 0, seed=14)
    a, s = permute_quant_cuda(x, row_to_token, offsets, None)
    assert a.shape == (0, 2048) and s.shape == (0, 16)
    # Every row padding (T = 0 with a non-empty segment): still written, from zeros.
    row_to_token = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 128, 128], dtype=torch.int32, device="cuda")
    _check_quant(x, row_to_token, offsets, "ue8m0")


def test_permute_quant_cuda_graph_new_routing():
    """The kernel reads expert_offsets[-1] on the device: a captured graph follows new routings."""
    offsets, row_to_token = routed_maps("skewed", 512, seed=15)
    x = random_activations(512, 7168, torch.bfloat16, seed=15)
    permute_quant_cuda(x, row_to_token, offsets, None)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, s = permute_quant_cuda(x, row_to_token, offsets, None)
    for seed in (16, 17):
        new_offsets, new_map = routed_maps("skewed", 512, seed=seed)
        assert new_map.shape == row_to_token.shape
        offsets.copy_(new_offsets)
        row_to_token.copy_(new_map)
        x.copy_(random_activations(512, 7168, torch.bfloat16, seed=seed))
        a.view(torch.uint8).fill_(0xFF)
        s.fill_(float("nan"))
        graph.replay()
        a_ref, s_ref = permute_quant_ref(x, row_to_token, offsets)
        end = _end(offsets)
        assert code_match_fraction(a[:end], a_ref[:end]) == 1.0 and same_bits(s[:end], s_ref[:end])


def test_permute_quant_rejects_misaligned_rows():
    offsets, row_to_token = routed_maps("ragged", 8, seed=18)
    x = random_activations(8, 2048 + 8, torch.bfloat16, seed=18)[:, 4 : 4 + 2048]
    with pytest.raises(ValueError, match="x"):
        permute_quant_cuda(x, row_to_token, offsets, None)


# ----------------------------------------------------------------------------- permute (FP8 in)


def _check_permute(a_in, a_in_scale, row_to_token, offsets):
    m_cap, hidden = row_to_token.shape[0], a_in.shape[1]
    poison_pools(m_cap * hidden + (64 << 20))
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
