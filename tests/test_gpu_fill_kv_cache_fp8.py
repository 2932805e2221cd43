"""fill_kv_cache_fp8's CuTe DSL kernel against the reference, on the GPU.

The caches start full of poison (random code bytes, NaN scales); the kernel's
caches and the reference's (applied to a copy) are compared whole, bit for bit:
written slots must match (codes identical on >= 99.99%, scales exact) and every
other byte must keep its poison.
"""
import pytest
import torch

import cute_moe
from cute_moe.reference import fill_kv_cache_fp8_ref

from .kv_cases import make_kv_case

pytestmark = pytest.mark.gpu


def _run_and_compare(case, group_size, scale_fmt, layout, launch=None):
    expected = [None if t is None else t.clone() for t in case.args()]
    fill_kv_cache_fp8_ref(*expected, group_size=group_size, scale_fmt=scale_fmt, layout=layout)
    if launch is None:
        cute_moe.fill_kv_cache_fp8(*case.args(), group_size=group_size, scale_fmt=scale_fmt, layout=layout)
    else:
        launch(*case.args(), group_size, scale_fmt, layout)
    for name, got, want in zip(("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"),
                               (case.k_cache, case.v_cache, case.k_scale_cache, case.v_scale_cache),
                               (expected[2], expected[3], expected[4], expected[5])):
        if got is None:
            continue
        if got.dtype == torch.float32:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
        else:
            same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
            assert same >= 0.9999, (name, same)


SCENARIOS = {
    "decode_b64": ([1] * 64, [int(i * 37 % 1000) for i in range(64)]),
    "decode_b512": ([1] * 512, [int(i * 53 % 3000) for i in range(512)]),
    "prefill_with_history": ([4096, 1000, 1], [0, 300, 77]),
    "mixed": ([1, 17, 1, 300, 64, 1, 2, 129], [5, 0, 640, 63, 64, 1, 1000, 3]),
    # the small-batch variant first checks sequence min(t, B - 1): right for most tokens here,
    # wrong for token 40 and tokens 102.. (the look-up by counting then decides; B > 128: two rounds)
    "decode_guess_misses": ([1] * 40 + [0, 2] + [1] * 60 + [0] * 3 + [1] * 30, [int(i * 41 % 900) for i in range(135)]),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_llama_style(scenario, layout, scale_fmt):
    q_lens, hist = SCENARIOS[scenario]
    case = make_kv_case(q_lens, hist, heads=8, head_dim=128, layout=layout, seed=len(q_lens) + len(layout))
    _run_and_compare(case, 128, scale_fmt, layout)


@pytest.mark.parametrize("q_lens", [[1, 700, 1, 33], [4000, 1, 300, 7]])  # both sides of the 4096-token switch
@pytest.mark.parametrize("group_size", [128, 512])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_mla_k_only(q_lens, group_size, layout):
    case = make_kv_case(q_lens, [90, 0, 2000, 5], heads=1, head_dim=512, with_v=False,
                        group_size=group_size, layout=layout, seed=group_size + len(layout) + q_lens[0])
    _run_and_compare(case, group_size, "ue8m0", layout)


CONFIGS = {  # heads, D, Dv (None: K only), group size, states dtype
    "llama": (8, 128, 128, 128, torch.bfloat16),
    "mla_g512": (1, 512, None, 512, torch.bfloat16),
    "heads16": (16, 128, 128, 128, torch.bfloat16),  # small batch: 4 warps per token, parts from pass 2
    "d256_dv512": (8, 256, 512, 128, torch.bfloat16),  # unequal sides: 3 warps per token
    "fp16_g32": (2, 64, 64, 32, torch.float16),
    "fp16_g256": (2, 256, 256, 256, torch.float16),
    "fp32_g256": (2, 256, 256, 256, torch.float32),  # 4 vectors per lane per group
    "bf16_g1024": (1, 1024, None, 1024, torch.bfloat16),  # 8 vectors per lane per group
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("small_batch", [False, True])
def test_both_variants(config, small_batch):
    """The prefill and the small-batch variant forced on the same mixed batch (one of them is not
    what the op would pick at this size), for head shapes, dtypes and group sizes of every kind."""
    from cute_moe.kernels.fill_kv_cache_fp8 import fill_kv_cache_fp8_cuda

    heads, dim, dim_v, group, dtype = CONFIGS[config]
    case = make_kv_case([300, 1, 93, 17, 1, 1], [0, 50, 700, 3, 64, 9], heads=heads, head_dim=dim,
                        with_v=dim_v is not None, head_dim_v=dim_v, group_size=group, dtype=dtype,
                        seed=len(config) + small_batch)  # fmt: skip

    def launch(*args):
        fill_kv_cache_fp8_cuda(*args, small_batch=small_batch)

    _run_and_compare(case, group, "ue8m0" if small_batch else None, "bshd", launch)


@pytest.mark.parametrize("small_batch", [False, True])
def test_unwritable_tokens_are_skipped(small_batch):
    """Tokens past cu_seqlens_q[-1] and tokens whose position falls before the cache start
    (kv_seqlens < q_len) are not written; the caches keep their poison there."""
    from cute_moe.kernels.fill_kv_cache_fp8 import fill_kv_cache_fp8_cuda

    case = make_kv_case([5, 40, 1], [0, 10, 3], heads=8, head_dim=128, seed=11 + small_batch)
    case.kv_seqlens[1] = 20  # sequence 1: its first 20 new tokens land before position 0
    case.cu_seqlens_q[3] = case.cu_seqlens_q[2]  # sequence 2 empty: the last token is past the end

    def launch(*args):
        fill_kv_cache_fp8_cuda(*args, small_batch=small_batch)

    _run_and_compare(case, 128, None, "bshd", launch)


@pytest.mark.parametrize("small_batch", [False, True])
def test_tokens_before_the_first_sequence_are_skipped(small_batch):
    """cu_seqlens_q[0] > 0 (a batch's prefill part passed with the whole k_states): tokens before it
    are in no sequence and not written. They were written as positions of sequence 0."""
    from cute_moe.kernels.fill_kv_cache_fp8 import fill_kv_cache_fp8_cuda

    case = make_kv_case([6, 1, 9], [0, 40, 70], heads=8, head_dim=128, seed=13 + small_batch)
    case.cu_seqlens_q[0] = 4  # tokens 0..3: no sequence; sequence 0 keeps tokens 4 and 5

    def launch(*args):
        fill_kv_cache_fp8_cuda(*args, small_batch=small_batch)

    _run_and_compare(case, 128, None, "bshd", launch)


def test_fp32_states_and_small_blocks():
    case = make_kv_case([3, 40], [10, 0], heads=4, head_dim=64, block_size=16, group_size=64,
                        dtype=torch.float32, seed=3)
    _run_and_compare(case, 64, None, "bshd")


def test_out_of_range_block_ids_are_skipped(monkeypatch):
    case = make_kv_case([5, 5], [0, 60], heads=8, head_dim=128, seed=4)
    case.block_offsets[1, 1] = case.k_cache.shape[0] + 3  # positions 64.. of sequence 1
    _run_and_compare(case, 128, None, "bshd")
    monkeypatch.setenv("CUTE_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match="block_offsets"):
        cute_moe.fill_kv_cache_fp8(*case.args())


def test_empty_batch():
    case = make_kv_case([], [], heads=8, head_dim=128, seed=5)
    cute_moe.fill_kv_cache_fp8(*case.args())


def test_decode_cuda_graph_replay():
    case = make_kv_case([1] * 64, list(range(0, 640, 10)), heads=8, head_dim=128, spare_blocks=64, seed=6)
    cute_moe.fill_kv_cache_fp8(*case.args())  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_moe.fill_kv_cache_fp8(*case.args())
    for step in range(1, 3):
        case.k_states.copy_(torch.randn_like(case.k_states, dtype=torch.float32).to(case.k_states.dtype))
        case.v_states.copy_(torch.randn_like(case.v_states, dtype=torch.float32).to(case.v_states.dtype))
        case.kv_seqlens += 1  # next decode position (one past the allocated blocks is skipped by both)
        expected = [None if t is None else t.clone() for t in case.args()]
        fill_kv_cache_fp8_ref(*expected)
        graph.replay()
        assert torch.equal(case.k_cache.view(torch.uint8), expected[2].view(torch.uint8))
        assert torch.equal(case.v_scale_cache.view(torch.int32), expected[5].view(torch.int32))
