"""Paged KV-cache scenarios shared by the fill_kv_cache_fp8 GPU test and benchmark."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KvCase:
    k_states: torch.Tensor
    v_states: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor | None
    k_scale_cache: torch.Tensor
    v_scale_cache: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    kv_seqlens: torch.Tensor
    block_offsets: torch.Tensor

    def args(self):
        return (self.k_states, self.v_states, self.k_cache, self.v_cache, self.k_scale_cache, self.v_scale_cache,
                self.cu_seqlens_q, self.kv_seqlens, self.block_offsets)


def make_kv_case(q_lens, histories, heads: int, head_dim: int, *, with_v: bool = True, block_size: int = 64,
                 group_size: int = 128, layout: str = "bshd", dtype=torch.bfloat16, seed: int = 0,
                 spare_blocks: int = 8, head_dim_v: int | None = None) -> KvCase:
    """Random states, a shuffled block table and caches full of poison (random bytes, NaN scales);
    V's head dim is ``head_dim_v`` (default: ``head_dim``)."""
    dim_v = head_dim if head_dim_v is None else head_dim_v
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_lens = torch.tensor(q_lens, dtype=torch.int64)
    kv_lens = q_lens + torch.tensor(histories, dtype=torch.int64)
    blocks_per_seq = (kv_lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + spare_blocks
    max_blocks = max(int(blocks_per_seq.max()) if len(q_lens) else 1, 1)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    table = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per_seq.tolist()):
        table[b, :n] = perm[start:start + n]
        start += n
    n_tok = int(q_lens.sum())

    def states(dim):
        x = torch.randn(n_tok, heads, dim, generator=g, device="cuda")
        return (x * torch.pow(10.0, torch.empty(n_tok, heads, 1, device="cuda").uniform_(-2, 2, generator=g))).to(dtype)

    def cache(dim, dtype_, per):
        shape = (num_blocks, block_size, heads, dim // per) if layout == "bshd" else (num_blocks, heads, block_size, dim // per)
        if dtype_ == torch.float32:
            return torch.full(shape, float("nan"), device="cuda")
        return torch.randint(0, 256, shape, generator=g, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)

    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    return KvCase(
        states(head_dim), states(dim_v) if with_v else None,
        cache(head_dim, torch.float8_e4m3fn, 1), cache(dim_v, torch.float8_e4m3fn, 1) if with_v else None,
        cache(head_dim, torch.float32, group_size), cache(dim_v, torch.float32, group_size) if with_v else None,
        cu.cuda(), kv_lens.to(torch.int32).cuda(), table,
    )
