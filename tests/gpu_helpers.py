"""Shared helpers for the GPU tests (marked ``gpu``; skipped without CUDA)."""

from __future__ import annotations

import torch


def poison_allocator(nbytes: int = 256 << 20, fill: int = 0xFF) -> None:
    """Fill the caching allocator's free memory with NaN bytes (0xFF; or ``fill``) and release it.

    Ops allocate their outputs with torch.empty, so a following op call reuses
    these bytes: any output element the kernel fails to write stays NaN / 0xFF.
    """
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.fill_(fill)
    del block


def random_activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with magnitudes spread over six decades, outliers, and one tiny group.

    Exercises every scale regime: the 1e-6 amax floor, ordinary groups, and
    groups whose amax is set by a single outlier.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.float32)
    x *= torch.pow(10.0, torch.empty(m, 1, device="cuda").uniform_(-3, 3, generator=g))
    if m and k:
        x[torch.randint(0, m, (max(1, m // 8),), device="cuda", generator=g), 0] *= 100.0
        x[0, : min(k, 128)] *= 1e-9
    # Inputs must be finite (documented): keep fp16 inside its range.
    return x.clamp(-6e4, 6e4).to(dtype)


def code_match_fraction(q: torch.Tensor, q_ref: torch.Tensor) -> float:
    if q.numel() == 0:
        return 1.0
    # An exact integer count: a float32 mean of more than 2**24 ones is not exactly 1.
    mismatches = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    return 1.0 - mismatches / q.numel()
