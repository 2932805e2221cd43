"""The launch memo on the GPU: replayed calls give what the Python path gives, bit for bit, on new
data, on a side stream and inside a CUDA graph (every other GPU test runs through it as well: its
second call with given metadata is a replay)."""
import pytest
import torch

import cute_moe
from cute_moe import launch_memo, ops
from cute_moe.reference import fused_moe_ref, quant_block_128x128_ref

from .gpu_helpers import poison_allocator, random_activations

pytestmark = pytest.mark.gpu

E, H, I, K, T = 16, 512, 256, 4, 64


def _python_path(name, *args):
    return ops._OPS[name].kernels["cuda"].__wrapped__(*args)


def _layer(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13, w13_scale = quant_block_128x128_ref(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5)
    w2, w2_scale = quant_block_128x128_ref(torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5)
    return w13, w13_scale, w2, w2_scale


def _tokens(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16), torch.randn(T, E, device="cuda", generator=g)


def _equal(a, b):
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_replays_equal_the_python_path_bit_for_bit():
    cute_moe.quant_fp8(random_activations(96, 1024, torch.bfloat16, seed=0))  # records
    for seed in range(1, 4):
        x = random_activations(96, 1024, torch.bfloat16, seed=seed)
        hits = launch_memo.stats()[1]
        poison_allocator()
        got = cute_moe.quant_fp8(x)
        assert launch_memo.stats()[1] == hits + 1
        assert _equal(got, _python_path("quant_fp8", x, 128, None, False))


def test_every_step_of_the_layer_is_replayed_and_the_layer_stays_right():
    weights = _layer(0)
    cute_moe.fused_moe(*_tokens(1), *weights, K, "softmax")  # records every step
    x, logits = _tokens(2)
    plans, hits, misses = launch_memo.stats()
    poison_allocator()
    got = cute_moe.fused_moe(x, logits, *weights, K, "softmax")
    new_plans, new_hits, new_misses = launch_memo.stats()
    assert new_plans == plans and new_misses == misses and new_hits >= 6  # route .. finalize
    want = fused_moe_ref(x, logits, *weights, K, "softmax")
    assert ((got.float() - want).norm() / want.norm()).item() <= 1e-2


def test_replay_on_a_side_stream_and_in_a_cuda_graph():
    weights = _layer(3)
    x, logits = _tokens(4)
    want = cute_moe.fused_moe(x, logits, *weights, K, "softmax")  # records (or replays)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = cute_moe.fused_moe(x, logits, *weights, K, "softmax")
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, want)

    static_x, static_logits = x.clone(), logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = cute_moe.fused_moe(static_x, static_logits, *weights, K, "softmax")
    x2, logits2 = _tokens(5)
    static_x.copy_(x2)
    static_logits.copy_(logits2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, cute_moe.fused_moe(x2, logits2, *weights, K, "softmax"))


def test_bad_input_still_raises_after_good_input_was_memoized():
    x = random_activations(32, 512, torch.bfloat16, seed=9)
    cute_moe.quant_fp8(x)
    cute_moe.quant_fp8(x)
    with pytest.raises(ValueError, match="group_size"):
        cute_moe.quant_fp8(x, group_size=96)
    with pytest.raises(ValueError):
        cute_moe.quant_fp8(x[:, :500])
