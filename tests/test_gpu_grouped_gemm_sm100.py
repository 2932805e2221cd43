"""grouped_gemm_fp8's Blackwell CuTe DSL kernel against the reference, on a B200/GB200.

Skipped unless the GPU has compute capability 10.0 (sm_100a): the kernel has so far only been
compiled and SASS-checked (``tests/test_compile_grouped_gemm_sm100.py``), never run.
Problems, routings and acceptance are those of the Hopper kernel's GPU test
(``tests/test_gpu_grouped_gemm.py``, helpers imported from there): NaN-poisoned
outputs, NaN codes and scales past the last segment, relative L2 <= 5e-3 overall and
per segment, <= 2e-2 per real row, padding rows exactly zero.  The cases cover both
DeepSeek-V3 GEMMs, N = 2112 (a half-filled last N tile, clipped by the TMA store),
empty experts, one hot expert, decode routings, M_cap = 65536 (more tiles than CTAs:
the persistent loop), one compiled function for two routings, and CUDA-graph replay
with routings rewritten in place.

The kernel runs clusters of 2 CTAs along N sharing the A tile by TMA multicast: an odd
number of 128-column N tiles (N = 2112: 17; N = 128: 1, so every visit of rank 1 is
multicast-only; N = 320: 3 with a partial third) makes the second CTA of the last tile
group feed its partner's A without storing anything; a hang in these tests points at
the cluster synchronization, wrong values in the columns of odd N tiles at the A
multicast.

On a GPU that is not a Blackwell, only the refusal is checked: the launcher raises
``NotImplementedError`` instead of launching.
"""

from __future__ import annotations

import random

import pytest
import torch

from .moe_cases import poison_pools
from .test_gpu_grouped_gemm import (
    BLOCK,
    check_output,
    decode_counts,
    deepgemm_counts,
    empty_counts,
    make_problem,
    one_expert_counts,
    reroute,
    routing_from_counts,
    routing_from_topk,
)

gg = pytest.importorskip("cute_moe.kernels.grouped_gemm_sm100")


def _is_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


pytestmark = pytest.mark.gpu
blackwell = pytest.mark.skipif(not _is_blackwell(), reason="needs a compute-capability-10.0 GPU (B200/GB200)")


def run_checked(p):
    poison_pools(max(256 << 20, p.a.shape[0] * p.b.shape[1] * 2 + (64 << 20)))
    c = gg.grouped_gemm_fp8_sm100_cuda(*p.args())
    check_output(c, p)
    return c


# id -> (E, N, K, routing builder(seed) -> Routing)
CASES = {
    "dsv3_w13_E8_ragged": (8, 4096, 7168, lambda s: routing_from_counts(deepgemm_counts(8, 4096, random.Random(s)))),
    "dsv3_w2_E8_ragged": (8, 7168, 2048, lambda s: routing_from_counts(deepgemm_counts(8, 4096, random.Random(s)))),
    "E1_N2112_K7168": (1, 2112, 7168, lambda s: routing_from_counts([1000])),
    "E32_N256_K1536_empty": (32, 256, 1536, lambda s: routing_from_counts(empty_counts(32, 512, random.Random(s)))),
    "E32_N4096_K1536_last_expert": (32, 4096, 1536, lambda s: routing_from_counts(one_expert_counts(32, 31, 5000))),
    "E8_N512_K128_Mcap65536_one_expert": (
        8, 512, 128, lambda s: routing_from_counts(one_expert_counts(8, 3, 65536), m_cap=65536)),
    "dsv3_w13_E256_decode": (256, 4096, 7168, lambda s: routing_from_counts(decode_counts(256, random.Random(s)))),
    "dsv3_w13_E256_T1": (256, 4096, 7168, lambda s: routing_from_topk(1, 8, 256, s)),
    "E256_N2112_K7168_T128": (256, 2112, 7168, lambda s: routing_from_topk(128, 8, 256, s)),
    # cluster edge cases: one N tile (rank 1 only multicasts), three with a partial last one,
    # and one K block (fewer K blocks than A/B stages: producer_tail on never-used stages)
    "E4_N128_K1536_one_n_tile": (
        4, 128, 1536, lambda s: routing_from_counts(deepgemm_counts(4, 300, random.Random(s)))),
    "E8_N320_K128_three_n_tiles": (8, 320, 128, lambda s: routing_from_counts(empty_counts(8, 300, random.Random(s)))),
}  # fmt: skip


@blackwell
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_fp8_sm100(case):
    E, N, K, build = CASES[case]
    seed = sum(map(ord, case)) * 7919
    run_checked(make_problem(E, N, K, build(seed), seed))


@blackwell
def test_grouped_gemm_fp8_sm100_empty():
    p = make_problem(8, 512, 4096, routing_from_counts([0] * 8, m_cap=256), seed=11)
    c = gg.grouped_gemm_fp8_sm100_cuda(*p.args())
    torch.cuda.synchronize()
    assert c.shape == (256, 512) and c.dtype == torch.bfloat16
    p = make_problem(4, 256, 1536, routing_from_counts([0] * 4, m_cap=0), seed=12)
    c = gg.grouped_gemm_fp8_sm100_cuda(*p.args())
    torch.cuda.synchronize()
    assert c.shape == (0, 256)


@blackwell
def test_grouped_gemm_fp8_sm100_routing_is_not_compiled_in():
    E, N, K, m_cap = 32, 512, 4096, 32 * (-(-int(384 * 1.3) // BLOCK) * BLOCK + BLOCK)
    first = routing_from_counts(deepgemm_counts(E, 384, random.Random(21)), m_cap=m_cap)
    second = routing_from_counts(empty_counts(E, 384, random.Random(22)), m_cap=m_cap)
    p = make_problem(E, N, K, first, seed=23)
    c1 = run_checked(p).clone()
    size = len(gg.compile_grouped_gemm_fp8_sm100.cache)
    saved = p.a.clone(), p.a_scale.clone(), first.offsets.clone(), first
    reroute(p, second, seed=24)
    run_checked(p)
    assert len(gg.compile_grouped_gemm_fp8_sm100.cache) == size, "a new routing compiled a new variant"
    p.a.copy_(saved[0])
    p.a_scale.copy_(saved[1])
    p.routing.offsets.copy_(saved[2])
    p.routing = saved[3]
    again = gg.grouped_gemm_fp8_sm100_cuda(*p.args())
    end = p.routing.end
    assert torch.equal(again[:end].view(torch.int16), c1[:end].view(torch.int16)), "not deterministic"


@blackwell
def test_grouped_gemm_fp8_sm100_cuda_graph():
    E, m_cap = 8, 8 * (-(-int(512 * 1.3) // BLOCK) * BLOCK + BLOCK)
    p = make_problem(E, 7168, 2048, routing_from_counts(deepgemm_counts(E, 512, random.Random(31)), m_cap=m_cap), 51)
    run_checked(p)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = gg.grouped_gemm_fp8_sm100_cuda(*p.args())
    later = [
        routing_from_counts(empty_counts(E, 512, random.Random(33)), m_cap=m_cap),
        routing_from_counts(one_expert_counts(E, 5, m_cap - BLOCK), m_cap=m_cap),
        routing_from_counts([0] * E, m_cap=m_cap),
    ]
    for i, routing in enumerate(later):
        reroute(p, routing, seed=60 + i)
        c.fill_(float("nan"))
        graph.replay()
        check_output(c, p)


@pytest.mark.skipif(not torch.cuda.is_available() or _is_blackwell(), reason="needs a GPU that is not a Blackwell")
def test_grouped_gemm_fp8_sm100_refuses_other_gpus():
    p = make_problem(2, 256, 256, routing_from_counts([100, 0]), seed=5)
    with pytest.raises(NotImplementedError, match="sm_100a"):
        gg.grouped_gemm_fp8_sm100_cuda(*p.args())
