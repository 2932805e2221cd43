"""``cute_moe.testing``, which the demo and the GPU tests check the full-size layer with, on the CPU:
its per-expert reference is ``reference.fused_moe_routed_ref``'s layer (every option), and its
random weights have the promised layout and range."""
import pytest
import torch

from cute_moe import reference as R
from cute_moe.testing import BLOCK, random_fp8_experts, reference_moe

E, H, I, T, K = 6, 256, 128, 24, 2


def _layer(seed: int):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = random_fp8_experts(E, 2 * I, H, g, device="cpu")
    w2, s2 = random_fp8_experts(E, H, I, g, device="cpu")
    x = (torch.randn(T, H, generator=g) * torch.rand(T, 1, generator=g) * 4).bfloat16()
    ids = torch.randint(-1, E + 2, (T, K), generator=g, dtype=torch.int32)  # some not local, some -1
    weights = torch.rand(T, K, generator=g)
    return x, ids, weights, w13, s13, w2, s2


@pytest.mark.parametrize(
    "options",
    [{}, {"expert_offset": 2}, {"gate_first": False}, {"act_scale_fmt": "ue8m0"},
     {"apply_router_weight_on_input": True}],
    ids=["plain", "ep_offset", "up_first", "ue8m0", "weight_on_input"],
)  # fmt: skip
def test_reference_moe_is_the_reference_layer(options):
    """Within the f32 rounding of its matmuls (against exact 128-wide block sums): rel L2 <= 1e-3,
    far under the 1e-2 the GPU tests allow the kernels, and the same tokens left at zero."""
    x, ids, weights, w13, s13, w2, s2 = _layer(seed=11)
    if options.get("apply_router_weight_on_input"):
        ids, weights = ids[:, :1], weights[:, :1]  # HF Llama-4's convention: top-1
    got = reference_moe(x, ids, weights, w13, s13, w2, s2, **options).float()
    want = R.fused_moe_routed_ref(x, ids, weights, w13, s13, w2, s2, **options).float()
    assert want.norm() > 0 and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() <= 1e-3
    assert torch.equal(got.abs().sum(1) == 0, want.abs().sum(1) == 0)


def test_reference_moe_of_no_tokens():
    x, ids, weights, w13, s13, w2, s2 = _layer(seed=3)
    out = reference_moe(x[:0], ids[:0], weights[:0], w13, s13, w2, s2)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


def test_random_fp8_experts_layout_and_range():
    codes, scales = random_fp8_experts(3, 256, 384, torch.Generator().manual_seed(1), device="cpu")
    assert codes.shape == (3, 256, 384) and codes.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 256 // BLOCK, 384 // BLOCK) and scales.dtype == torch.float32
    assert codes.float().abs().max() == 448  # the whole e4m3 range, as a checkpoint's amax/448 blocks
    assert (scales > 0).all() and scales.max() / scales.min() > 1.5  # a wrong block's scale shows
    with pytest.raises(ValueError, match="multiples of 128"):
        random_fp8_experts(1, 200, 384, torch.Generator(), device="cpu")
