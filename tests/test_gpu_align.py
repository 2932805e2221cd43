"""align's CuTe DSL kernel against ``reference.align_ref``, bit for bit, on the GPU.

``align_cuda`` is called directly on fresh random top-k ids (k distinct experts
per token, as routing produces), and all four outputs are compared with the
reference's with ``torch.equal``: the kernel is a stable counting sort, so
there is exactly one right answer.  Covered: T in {0, 1, 7, 128, 4096, 65536}
x E in {8, 64, 128, 256, 384, 512} x k in {1, 2, 6, 8}; other alignments; the
single-launch and two-launch variants at sizes either may get (``ctas``);
expert-parallel shards (most entries not local); every entry on one expert;
CUDA-graph replay with new ids; a side stream.

Poisoning: ``gpu_helpers.poison_allocator`` fills freed memory with 0xFF bytes,
which is int32 -1 -- the very value align writes into every unused row, so it
cannot reveal a row the kernel forgot.  Each check therefore runs twice: once
after ``poison_allocator`` and once after ``_poison_int32``, which leaves
0x5A5A5A5A in the caching allocator's large *and* small pools (align's offsets
and counts are small allocations, served from a different pool than the 256 MB
block ``poison_allocator`` frees).
"""

import pytest
import torch

from cute_moe.kernels.align import align_cuda
from cute_moe.reference import align_ref, m_cap

from .gpu_helpers import poison_allocator

pytestmark = pytest.mark.gpu

TOKENS = [0, 1, 7, 128, 4096, 65536]
EXPERTS = [8, 64, 128, 256, 384, 512]
TOPK = [1, 2, 6, 8]
POISON = 0x5A5A5A5A


def _poison_int32() -> None:
    """0x5A bytes in freed blocks of both pools of the caching allocator."""
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
    sizes = [512, 4096, 65536, 1 << 19] * 8
    blocks += [torch.empty(sz, dtype=torch.uint8, device="cuda") for sz in sizes]
    for b in blocks:
        b.fill_(0x5A)
    del blocks


def _ids(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :k].to(torch.int32).contiguous()


def _check(ids, E, alignment=128, expert_offset=0, E_local=None, ctas=None):
    want = align_ref(ids, E, alignment, expert_offset, E_local)
    for poison in (poison_allocator, _poison_int32):
        poison()
        got = align_cuda(ids, E, alignment, expert_offset, E_local, ctas)
        names = ("expert_offsets", "row_to_token", "token_to_row", "expert_counts")
        for name, g, w in zip(names, got, want):
            assert g.dtype == torch.int32 and g.shape == w.shape and g.is_contiguous(), name
            if not torch.equal(g, w):
                bad = (g != w).nonzero()
                raise AssertionError(
                    f"{name}: {bad.shape[0]} entries differ (poison {poison.__name__}); first at "
                    f"{tuple(bad[0].tolist())}: got {g[tuple(bad[0])].item()}, want {w[tuple(bad[0])].item()}"
                )


@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("E", EXPERTS)
@pytest.mark.parametrize("T", TOKENS)
def test_align(T, E, k):
    _check(_ids(T, k, E, seed=T * 7919 + E * 31 + k), E)


@pytest.mark.parametrize("alignment", [1, 16, 64, 100])
@pytest.mark.parametrize("T,k,E", [(1, 8, 256), (333, 6, 64), (16384, 8, 256)])
def test_align_other_alignments(T, k, E, alignment):
    _check(_ids(T, k, E, seed=T + alignment), E, alignment)


@pytest.mark.parametrize("T", [1, 7, 4096, 16384])
def test_align_expert_parallel_shards(T):
    E, ranks = 256, 8
    ids = _ids(T, 8, E, seed=T)
    for r in range(ranks):  # DeepSeek-V3 on 8 ranks: 32 experts each
        _check(ids, E, 128, r * (E // ranks), E // ranks)
    _check(ids, E, 128, 200, 56)  # last rank of an uneven split
    _check(ids, E, 16, 7, 1)  # a single local expert
    _check(_ids(T, 6, 384, seed=T + 1), 384, 128, 0, 384)  # E_local = E, explicit


@pytest.mark.parametrize("T", [1, 300, 16384])
def test_align_masked_slots(T):
    """-1 ids (vLLM's expert map for another rank's expert) are not local: bit for bit the reference's
    segments, whole and as an expert-parallel shard."""
    ids = _ids(T, 8, 256, seed=T + 3)
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.where(torch.rand(ids.shape, generator=g, device="cuda") < 0.3, -1, ids).contiguous()
    _check(ids, 256)
    _check(ids, 256, 128, 64, 32)


@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (129, 2), (65536, 8)])
def test_align_every_entry_on_one_expert(T, k):
    ids = torch.full((T, k), 5, dtype=torch.int32, device="cuda")
    _check(ids, 64)
    _check(ids, 64, 128, 4, 2)  # local experts 4, 5: expert 4 empty
    _check(ids, 64, 128, 6, 8)  # nothing local: all -1
    # Skewed: most entries on expert 0, the rest random.
    skew = _ids(T, k, 64, seed=T + k)
    skew[: T // 2 + 1, 0] = 0
    _check(skew, 64)


@pytest.mark.parametrize("ctas", [1, 2, 3, 32])
@pytest.mark.parametrize("T,k,E", [(1, 8, 256), (7, 6, 64), (128, 8, 256), (5000, 8, 384), (16384, 8, 256)])
def test_align_cta_counts(T, k, E, ctas):
    """Either variant at any size (``align_ctas`` picks the two-launch one from T * k = 4096 up):
    chunks that are empty, partial, or cut through a run of one expert's entries."""
    ids = _ids(T, k, E, seed=T + ctas)
    _check(ids, E, ctas=ctas)
    _check(ids, E, 16, E // 4, E // 8, ctas=ctas)  # an expert-parallel shard
    _check(ids, E, 1, 3, 1, ctas=ctas)  # one local expert, no padding
    ids[: T // 2 + 1] = 3  # skewed: a run of expert 3 across chunk boundaries
    _check(ids, E, ctas=ctas)


def test_align_largest_table():
    _check(_ids(4096, 8, 1024, seed=3), 1024)
    _check(_ids(3, 8, 1024, seed=4), 1024, 128, 0, 1024)


def test_align_noncontiguous_ids():
    wide = _ids(500, 16, 128, seed=5)
    _check(wide[:, ::2], 128)


def test_align_side_stream_and_cuda_graph():
    T, k, E = 4096, 8, 256
    ids = _ids(T, k, E, seed=6)
    align_cuda(ids, E)  # compile and load before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = align_cuda(ids, E)
    torch.cuda.current_stream().wait_stream(stream)
    for g, w in zip(got, align_ref(ids, E)):
        assert torch.equal(g, w)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = align_cuda(ids, E)
    assert outs[1].shape == (m_cap(T, k, E, 128),)
    for seed in (7, 8, 9):
        new = _ids(T, k, E, seed=seed)
        if seed == 9:  # a very different routing: everything on two experts
            new = torch.where(new % 2 == 0, 17, 230).to(torch.int32)
        ids.copy_(new)
        for o in outs:
            o.fill_(POISON)
        graph.replay()
        for o, w in zip(outs, align_ref(ids, E)):
            assert torch.equal(o, w), seed


def test_align_graph_captured_at_a_size_the_warmup_did_not_reach():
    """An eager call at T=1 (one launch) compiles the two-launch steps too, so a graph captured at
    T=4096 (two launches) needs no compile.  A configuration no other test uses keeps the compile
    cache cold until the warm-up."""
    E, k, alignment, offset, E_local = 96, 8, 32, 5, 40
    align_cuda(_ids(1, k, E, seed=10), E, alignment, offset, E_local)
    ids = _ids(4096, k, E, seed=11)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = align_cuda(ids, E, alignment, offset, E_local)
    ids.copy_(_ids(4096, k, E, seed=12))
    for o in outs:
        o.fill_(POISON)
    graph.replay()
    for o, w in zip(outs, align_ref(ids, E, alignment, offset, E_local)):
        assert torch.equal(o, w)
