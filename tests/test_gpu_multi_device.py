"""Ops on a GPU other than the current one (a process that owns two devices): the kernels must
launch on the tensors' device and that device's current stream, not on the current device.

Needs two GPUs (skipped otherwise, also when CUDA is present).  Checked on cuda:1 with cuda:0
current: quant_fp8 (functional and ``torch.ops``) bit for bit against the reference, and a small
fused_moe (every kernel of the layer: route, align, permute_quant, both GEMMs, silu_mul_quant,
finalize) within the layer tolerance of test_gpu_fused_moe (relative L2 <= 1e-2 against the f32
reference on the same FP8 weights).  Also: a side stream of cuda:1 is the one the kernels use.
"""
import pytest
import torch

import cute_moe
from cute_moe.reference import fused_moe_ref, quant_block_128x128_ref, quant_fp8_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.fixture
def other_device():
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield torch.device("cuda:1")
    torch.cuda.set_device(previous)


def _rel_l2(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_quant_fp8_on_another_device(other_device):
    x = torch.randn(64, 1024, device=other_device, dtype=torch.bfloat16) * 3
    q_ref, s_ref = quant_fp8_ref(x)
    for q, s in (cute_moe.quant_fp8(x), torch.ops.cute_moe.quant_fp8(x, 128, None, False)):
        assert q.device == other_device and s.device == other_device
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_fused_moe_on_another_device_and_its_side_stream(other_device):
    E, H, I, k, T = 16, 512, 256, 4, 64
    g = torch.Generator(device=other_device).manual_seed(0)
    w13, w13_scale = quant_block_128x128_ref(torch.randn(E, 2 * I, H, device=other_device, generator=g) * H**-0.5)
    w2, w2_scale = quant_block_128x128_ref(torch.randn(E, H, I, device=other_device, generator=g) * I**-0.5)
    x = torch.randn(T, H, device=other_device, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, device=other_device, generator=g)
    args = (x, logits, w13, w13_scale, w2, w2_scale, k, "softmax")
    want = fused_moe_ref(*args)
    got = cute_moe.fused_moe(*args)
    assert got.device == other_device and _rel_l2(got, want) <= 1e-2
    side = torch.cuda.Stream(device=other_device)
    side.wait_stream(torch.cuda.current_stream(other_device))
    with torch.cuda.stream(side):
        on_side = cute_moe.fused_moe(*args)
    torch.cuda.current_stream(other_device).wait_stream(side)
    assert torch.equal(on_side, got)
