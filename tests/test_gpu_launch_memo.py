"""The launch memo on the GPU: replayed calls (through the functional API, and through torch.ops
without entering Python) give what the Python path gives, bit for bit, on new data, on a side
stream and inside a CUDA graph (every other GPU test runs through it as well: its
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
    for seed in (0, 10):  # the call that compiles records nothing; the next one records
        cute_moe.quant_fp8(random_activations(96, 1024, torch.bfloat16, seed=seed))
    for seed in range(1, 4):
        x = random_activations(96, 1024, torch.bfloat16, seed=seed)
        hits = launch_memo.stats()[1]
        poison_allocator()
        got = cute_moe.quant_fp8(x)
        assert launch_memo.stats()[1] == hits + 1
        assert _equal(got, _python_path("quant_fp8", x, 128, None, False))


def test_every_step_of_the_layer_is_replayed_and_the_layer_stays_right():
    weights = _layer(0)
    for seed in (1, 11):  # compiles, then records every step
        cute_moe.fused_moe(*_tokens(seed), *weights, K, "softmax")
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


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _routing(g, tokens=64, experts=E, k=K):
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:k] for _ in range(tokens)]).int()
    return ops.call("align", ids, experts, 128, 0, None)


def _case_align(seed):  # T*k = 8192: the two-launch path
    g = _gen(seed)
    return (torch.randint(0, 256, (1024, 8), device="cuda", generator=g, dtype=torch.int32), 256, 128, 0, None)


def _case_route(seed):
    g = _gen(seed)
    logits = torch.randn(33, 256, device="cuda", generator=g)
    return (logits, 8, "deepseek_v3", torch.randn(256, device="cuda", generator=g), 8, 4, 2.5)


def _case_silu_up_first(seed):
    off = _routing(_gen(seed))[0]
    h = torch.randn(cute_moe.m_cap(T, K, E, 128), 2 * I, device="cuda", generator=_gen(seed + 1))
    return (h.to(torch.bfloat16), off, False, None)


def _case_gemm_k128(seed):
    g = _gen(seed)
    off, r2t, _, counts = _routing(g)
    a, a_scale = ops.call("permute_quant", torch.randn(T, 128, device="cuda", generator=g).to(torch.bfloat16), r2t,
                          off, None)  # fmt: skip
    b, b_scale = quant_block_128x128_ref(torch.randn(E, 256, 128, device="cuda", generator=g))
    return (a, a_scale, b, b_scale, off, None)


def _case_fill_kv_from_one_qkv(seed):
    g = _gen(seed)
    qkv = torch.randn(3, 3, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    caches = [torch.zeros(4, 16, 8, 128, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.zeros(4, 16, 8, 1, device="cuda") for _ in range(2)]
    meta = (torch.tensor([0, 3], device="cuda", dtype=torch.int32), torch.tensor([7], device="cuda", dtype=torch.int32),
            torch.arange(4, device="cuda", dtype=torch.int32).view(1, 4))  # fmt: skip
    return (qkv[:, 1], qkv[:, 2], *caches, *scales, *meta, 128, None, "bshd")


@pytest.mark.parametrize(
    "name, case",
    [("align", _case_align), ("route", _case_route), ("silu_mul_quant", _case_silu_up_first),
     ("grouped_gemm_fp8", _case_gemm_k128), ("fill_kv_cache_fp8", _case_fill_kv_from_one_qkv)],  # fmt: skip
)
@pytest.mark.parametrize("path", ["functional", "torch.ops"])
def test_each_op_replays_bit_for_bit(name, case, path, monkeypatch):
    op = (lambda *a: ops.call(name, *a)) if path == "functional" else getattr(torch.ops.cute_moe, name)
    for seed in (0, 2):  # compiles, then records
        op(*case(seed))
    args = case(1)
    hits = launch_memo.stats()[1]
    python_calls = []  # the memo's Python function asks this on every call it gets
    monkeypatch.setattr(launch_memo, "recording", lambda: python_calls.append(1))
    got = op(*args)
    monkeypatch.undo()
    assert launch_memo.stats()[1] == hits + 1, "not replayed"
    assert len(python_calls) == (1 if path == "functional" else 0), "torch.ops replay entered Python"
    twin = case(1)  # the same inputs again, for the Python path
    want = _python_path(name, *twin)
    torch.cuda.synchronize()
    if want is None:  # in place: compare what each path wrote
        got, want = args[2:6], twin[2:6]
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    # rows past the last segment are never written by silu_mul_quant and the GEMM (unspecified)
    end = int(args[4 if name == "grouped_gemm_fp8" else 1][-1]) if name in ("silu_mul_quant", "grouped_gemm_fp8") else None
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.stride() == w_.stride() and g_.dtype == w_.dtype
        assert torch.equal(g_[:end].contiguous().view(torch.uint8), w_[:end].contiguous().view(torch.uint8))
