"""Random MoE routings (on the GPU) shared by the permute_quant / permute / silu_mul_quant GPU tests.

Each routing is top-k expert ids run through ``reference.align_ref`` with the
GEMM's row alignment (128), so the row maps are exactly what the pipeline hands
the kernels: ragged segments, empty experts, one hot expert, and an
expert-parallel shard whose non-local entries leave ``expert_offsets[-1]`` far
below ``M_cap``.
"""
from __future__ import annotations

import torch

from cute_moe.reference import align_ref

from .gpu_helpers import code_match_fraction, poison_allocator

ALIGNMENT = 128

# name -> (global experts E, top_k, expert_offset, local experts)
ROUTINGS = {
    "ragged": (32, 8, 0, 32),  # every expert gets a random share
    "skewed": (64, 4, 0, 64),  # Zipf-like popularity: hot experts, many empty ones at small T
    "one_expert": (8, 1, 0, 8),  # every token on the last expert: segments 0..6 empty
    "ep_shard": (64, 8, 16, 16),  # local experts [16, 32): most entries are not local
}


def topk_ids(routing: str, num_tokens: int, seed: int) -> torch.Tensor:
    """[T, k] int32 expert ids, k distinct per token, for the named routing."""
    num_experts, k, _, _ = ROUTINGS[routing]
    g = torch.Generator(device="cuda").manual_seed(seed)
    if routing == "one_expert":
        return torch.full((num_tokens, k), num_experts - 1, dtype=torch.int32, device="cuda")
    if routing == "skewed":
        popularity = 1.0 / torch.arange(1, num_experts + 1, device="cuda", dtype=torch.float32) ** 1.5
        popularity = popularity[torch.randperm(num_experts, generator=g, device="cuda")]
        if num_tokens == 0:
            return torch.empty((0, k), dtype=torch.int32, device="cuda")
        ids = torch.multinomial(popularity.expand(num_tokens, num_experts), k, replacement=False, generator=g)
        return ids.to(torch.int32)
    scores = torch.rand(num_tokens, num_experts, generator=g, device="cuda")
    return scores.argsort(dim=1)[:, :k].to(torch.int32).contiguous()


def routed_maps(routing: str, num_tokens: int, seed: int):
    """(expert_offsets [E_local + 1], row_to_token [M_cap]) for a fresh random routing."""
    num_experts, _, expert_offset, local = ROUTINGS[routing]
    ids = topk_ids(routing, num_tokens, seed)
    offsets, row_to_token, _, _ = align_ref(ids, num_experts, ALIGNMENT, expert_offset, local)
    return offsets, row_to_token


def routed_maps_with_counts(routing: str, num_tokens: int, seed: int, alignment: int = ALIGNMENT):
    """(expert_offsets [E_local + 1], row_to_token [M_cap], expert_counts [E_local]) for a fresh
    random routing (the same routing as ``routed_maps`` with the same arguments)."""
    num_experts, _, expert_offset, local = ROUTINGS[routing]
    ids = topk_ids(routing, num_tokens, seed)
    offsets, row_to_token, _, counts = align_ref(ids, num_experts, alignment, expert_offset, local)
    return offsets, row_to_token, counts


def real_rows(offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 indices of the real rows ``[off[e], off[e] + counts[e])`` of every segment, ascending."""
    off, cnt = offsets.tolist(), counts.tolist()
    idx = [r for e, c in enumerate(cnt) for r in range(off[e], off[e] + c)]
    return torch.tensor(idx, dtype=torch.long, device=offsets.device)


def padding_rows(offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 indices of the padding rows ``[off[e] + counts[e], off[e + 1])`` of every segment."""
    off, cnt = offsets.tolist(), counts.tolist()
    idx = [r for e, c in enumerate(cnt) for r in range(off[e] + c, off[e + 1])]
    return torch.tensor(idx, dtype=torch.long, device=offsets.device)


def poison_pools(large_bytes: int, fill: int = 0xFF, small_chunk: int = 1 << 19) -> None:
    """Fill the caching allocator's free memory with 0xFF (NaN for f32; or ``fill``), in both of
    its pools.

    ``gpu_helpers.poison_allocator`` poisons one large block; outputs under 1 MB come
    from the small pool (2 MB segments), which this poisons too, 32 MB in ``small_chunk``-byte
    pieces: best fit puts a piece in any free fragment at least that big, so an output that is
    smaller than a fragment left unpoisoned needs a ``small_chunk`` at or below its own size.
    """
    poison_allocator(large_bytes, fill)
    small = [torch.empty(small_chunk, dtype=torch.uint8, device="cuda") for _ in range((32 << 20) // small_chunk)]
    for t in small:
        t.fill_(fill)
    del small


def zero_pools_for(out_bytes: int) -> None:
    """``poison_pools`` with zeros, for an output whose unwritten elements must not pass as NaN:
    the cache emptied first and the small pool filled in pieces no bigger than the output, so that
    it cannot land in a fragment left as an earlier test wrote it."""
    torch.cuda.empty_cache()
    poison_pools(256 << 20, fill=0, small_chunk=min(1 << 19, 1 << (max(out_bytes, 512).bit_length() - 1)))


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equality of two f32 tensors of one shape (any strides)."""
    return got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32))


def assert_rows_match(a, s, a_ref, s_ref, end: int, exact_codes: bool = False) -> None:
    """Codes [M_cap, K] e4m3 and MN-major scales [M_cap, K/128] against the reference on rows < end:
    codes identical on >= 99.99% (or all of them), scales bit-exact."""
    m_cap, cols = a_ref.shape
    assert a.shape == (m_cap, cols) and a.dtype == torch.float8_e4m3fn
    assert s.shape == (m_cap, cols // 128) and s.stride() == (1, m_cap) and s.dtype == torch.float32
    if exact_codes:
        assert torch.equal(a[:end].view(torch.uint8), a_ref[:end].view(torch.uint8))
    else:
        assert code_match_fraction(a[:end], a_ref[:end]) >= 0.9999
    assert same_bits(s[:end], s_ref[:end]), (s[:end] - s_ref[:end]).abs().max()


def poisoned_outputs(m_cap: int, cols: int):
    """(codes as uint8 full of 0xFF, MN-major f32 scales full of NaN) for a direct kernel call."""
    a = torch.full((m_cap, cols), 0xFF, dtype=torch.uint8, device="cuda")
    s = torch.full((cols // 128, m_cap), float("nan"), device="cuda").t()
    return a, s


def assert_past_end_untouched(a: torch.Tensor, s: torch.Tensor, end: int) -> None:
    assert end < a.shape[0]
    assert bool((a[end:].view(torch.uint8) == 0xFF).all()) and bool(s[end:].isnan().all())
