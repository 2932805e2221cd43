"""Shared pytest setup: skip ``gpu`` tests without CUDA; a per-test random-input factory; a
torch.compile frame counter that fails on recompiles."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch._dynamo.testing

from cute_moe import reference as R


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker; this keeps a bare checkout free of warnings.
    if not any(str(m).startswith("gpu") for m in config.getini("markers")):
        config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch.cuda.is_available() is False)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Rand:
    """Fresh random inputs (never zeros) from a generator seeded by the test's id."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype)

    def topk_ids(self, T: int, k: int, E: int) -> torch.Tensor:
        """[T, k] int32, k distinct experts per token in [0, E)."""
        return torch.rand(T, E, generator=self.gen).argsort(dim=1)[:, :k].to(torch.int32).contiguous()

    def weights(self, T: int, k: int) -> torch.Tensor:
        return torch.rand(T, k, generator=self.gen) + 0.1

    def expert_weights(self, E: int, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 expert weights [E, N, K] with 128x128 f32 block scales [E, ceil(N/128), K/128]."""
        return R.quant_block_128x128_ref(torch.randn(E, N, K, generator=self.gen) * 0.05)


@pytest.fixture
def rnd(request: pytest.FixtureRequest) -> Rand:
    return Rand(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def compile_counter():
    """A fresh dynamo state that fails on any recompile, plus a counter of compiled frames."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield counter
    torch._dynamo.reset()
