"""finalize's and moe_reduce's CuTe DSL kernels against the references, on the GPU.

The kernels are called directly (``finalize_cuda``, ``moe_reduce_cuda``) on fresh
random data, their outputs allocated from a NaN-poisoned allocator, and compared
bit for bit:

* finalize: identical to ``reference.finalize_ref`` (both compute
  ``acc = RN(acc + RN(w * y))`` in f32 in order j, then one RN cast to bf16).
  Index maps come from ``reference.align_ref`` on random top-k ids, including
  expert-parallel shards (``expert_offset`` / ``num_local_experts``) where many
  entries are -1, and skewed routing (every token on the same k experts: k = 1 puts
  all tokens on one expert).  Every row of y that no entry names (segment padding, rows past
  the last segment) and every weight of a -1 entry is NaN: one read of them shows
  up as NaN in the output.
* moe_reduce: identical to ``reference.moe_reduce_ref`` in both accumulation modes
  (with ``fp32_acc=False`` and 16-bit rows both round every product and running sum
  to the row dtype, in order j, as lmdeploy does).

T = 65536 (the grid's x dimension past 65535) runs for one top-k and H of each op (k = 8,
H = 2048: Qwen3-30B-A3B's shape), not the whole cross product; its memory is stated there.
"""

import pytest
import torch

from cute_moe.kernels.finalize import finalize_cuda
from cute_moe.kernels.moe_reduce import moe_reduce_cuda
from cute_moe.reference import align_ref, finalize_ref, moe_reduce_ref

from .moe_cases import poison_pools


pytestmark = pytest.mark.gpu

TOKENS = [0, 1, 7, 128, 4096]
TOPK = [1, 2, 6, 8]
HIDDEN = [2048, 4096, 7168]


def _gen(seed: int, device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _rows(m: int, h: int, g: torch.Generator, device: str) -> torch.Tensor:
    """f32 rows with magnitudes spread over four decades (every rounding regime of bf16)."""
    scale = torch.pow(10.0, torch.empty(m, 1, device=device).uniform_(-2, 2, generator=g))
    return torch.randn(m, h, generator=g, device=device).mul_(scale)  # in place: one [m, h] f32 buffer


def _weights(t: int, k: int, g: torch.Generator, device: str) -> torch.Tensor:
    """Routing-like weights, some negative so that sums cancel."""
    return torch.rand(t, k, generator=g, device=device) * 1.2 - 0.1


def finalize_case(T, k, H, seed, *, shard="all", num_experts=16, alignment=128, row_pad=0, skewed=False,
                  device="cuda"):  # fmt: skip
    """(y, topk_weights, token_to_row) with NaN in every y row and weight the op must not read.

    shard="ep": this rank owns the second quarter of the experts, so most entries are -1.
    row_pad > 0: y is a column slice of a wider buffer (row stride H + row_pad), the pad NaN.
    skewed: every token routed to the same k experts, ``E/4 .. E/4 + k - 1`` (k = 1: all tokens on
    one expert): k segments of T rows, every other expert empty; on the EP shard (local experts
    ``[E/4, E/2)``) the first min(k, E/4) of them are local, the rest give -1 entries.
    """
    g = _gen(seed, device)
    if skewed:
        hot = (num_experts // 4 + torch.arange(k, device=device)) % num_experts
        ids = hot.to(torch.int32).expand(T, k).contiguous()
    else:
        ids = torch.rand(T, num_experts, generator=g, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    if shard == "ep":
        quarter = num_experts // 4
        _, r2t, t2r, _ = align_ref(ids, num_experts, alignment, expert_offset=quarter, num_local_experts=quarter)
    else:
        _, r2t, t2r, _ = align_ref(ids, num_experts, alignment)
    m_cap = r2t.shape[0]
    # Built in bf16 (the same values as an f32 buffer cast to bf16, without its [M_cap, H] f32 copy)
    buf = torch.full((m_cap, H + row_pad), float("nan"), dtype=torch.bfloat16, device=device)
    named = torch.zeros(m_cap, dtype=torch.bool, device=device)
    named[t2r[t2r >= 0].long()] = True
    buf[named, :H] = _rows(int(named.sum()), H, g, device).to(torch.bfloat16)
    y = buf[:, :H]
    w = _weights(T, k, g, device)
    w[t2r < 0] = float("nan")
    return y, w, t2r


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _run(launch, reference, dtype, unread: str, out_bytes: int = 0):
    """(kernel output from a poisoned allocator, reference), with the checks both ops share.

    The cache is emptied first, so that the output (``out_bytes``) can only come from poisoned
    memory: the large block, sized to hold it (a bigger cached block would be passed over by best
    fit, a smaller one not hold it), or, for outputs of 1 MB or less, the small pool's."""
    torch.cuda.empty_cache()
    poison_pools(max(256 << 20, out_bytes + (64 << 20)))
    out, ref = launch(), reference()
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert not out.isnan().any(), f"{unread} was read, or an output was left unwritten"
    return out, ref


def _check_finalize(y, w, t2r):
    out, ref = _run(lambda: finalize_cuda(y, w, t2r), lambda: finalize_ref(y, w, t2r), torch.bfloat16,
                    "a skipped row or weight", w.shape[0] * y.shape[1] * 2)  # fmt: skip
    assert torch.equal(_bits(out), _bits(ref)), (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shard", ["all", "ep"])
def test_finalize(T, k, H, shard):
    _check_finalize(*finalize_case(T, k, H, seed=T * 1009 + k * 31 + H + (shard == "ep"), shard=shard))


@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("T", [1, 128, 4096])
@pytest.mark.parametrize("shard", ["all", "ep"])
def test_finalize_skewed_routing(T, k, shard):
    """Every token on the same k experts (k = 1: all tokens to one expert): each token's rows are
    ``off[e_j] + t``, k long segments and every other expert empty; on the EP shard part (k > 4) or
    all (k <= 4) of the hot experts are local."""
    _check_finalize(*finalize_case(T, k, 4096, seed=T * 1019 + k * 41 + (shard == "ep"), shard=shard, skewed=True))


@pytest.mark.parametrize("shard", ["all", "ep"])
def test_finalize_65536_tokens(shard):
    """T = 65536 tokens (the grid's x dimension past 65535) at k = 8, H = 2048: y is
    [526,336, 2048] bf16, 2.16 GB, so its byte offsets pass 2**31.  GPU memory: y 2.2 GB, the
    case's f32 draw 4.3 GB (transient), the reference's f32 copies of y 2 x 4.3 GB; peak ~11 GB,
    a few seconds."""
    _check_finalize(*finalize_case(65536, 8, 2048, seed=65536 + (shard == "ep"), shard=shard))


def test_finalize_strided_y_and_weights():
    T, k, H = 333, 8, 4096
    y, w, t2r = finalize_case(T, k, H, seed=1, row_pad=64)
    assert y.stride(0) == H + 64
    # [T, k] maps with row stride 2k, the other half poisoned (never read).
    w_wide = torch.full((T, 2 * k), float("nan"), device="cuda")
    w_wide[:, :k] = w
    t2r_wide = torch.full((T, 2 * k), 1 << 30, dtype=torch.int32, device="cuda")
    t2r_wide[:, :k] = t2r
    _check_finalize(y, w_wide[:, :k], t2r_wide[:, :k])


def test_finalize_top1_column_weights():
    y, w, t2r = finalize_case(100, 1, 2048, seed=2)
    # [T, 1] views whose size-1 column has a non-unit stride (validation allows any).
    _check_finalize(y, w.as_strided((100, 1), (1, 5)), t2r.as_strided((100, 1), (1, 5)))


@pytest.mark.parametrize("k", [16, 32])
def test_finalize_large_topk(k):
    # k > 8: the rows go in batches of 8 loads.
    _check_finalize(*finalize_case(257, k, 2048, seed=k, num_experts=64, alignment=16))
    _check_finalize(*finalize_case(257, k, 2048, seed=k + 1, num_experts=64, alignment=16, shard="ep"))


def test_finalize_zero_topk_and_all_skipped():
    y, w, t2r = finalize_case(9, 2, 2048, seed=3)
    out = finalize_cuda(y, w[:, :0], t2r[:, :0])
    assert out.shape == (9, 2048) and torch.all(out == 0)
    t2r_none = torch.full_like(t2r, -1)
    w_nan = torch.full_like(w, float("nan"))
    out = finalize_cuda(y, w_nan, t2r_none)
    assert torch.equal(_bits(out), torch.zeros_like(_bits(out)))  # +0.0, like the reference


def test_finalize_out_of_range_rows_are_skipped(monkeypatch):
    y, w, t2r = finalize_case(50, 4, 2048, seed=4)
    bad = t2r.clone()
    bad[3, 1] = y.shape[0] + 5
    bad[7, 0] = -3
    expected = finalize_ref(y, w, torch.where((bad >= 0) & (bad < y.shape[0]), bad, -1))
    w_nan = w.clone()
    w_nan[3, 1] = w_nan[7, 0] = float("nan")
    out = finalize_cuda(y, w_nan, bad)
    assert torch.equal(_bits(out), _bits(expected))
    monkeypatch.setenv("CUTE_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match="token_to_row"):
        finalize_cuda(y, w, bad)


def test_finalize_rejects_unsupported_layouts():
    y, w, t2r = finalize_case(4, 2, 2048 + 8, seed=5, row_pad=8)
    with pytest.raises(ValueError, match="y"):
        finalize_cuda(y[:, 4:4 + 2048], w, t2r)  # 8-byte aligned rows
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        finalize_cuda(y[:, :2044], w, t2r)


def test_finalize_side_stream_and_cuda_graph():
    y, w, t2r = finalize_case(64, 8, 7168, seed=6)
    finalize_cuda(y, w, t2r)  # compile before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = finalize_cuda(y, w, t2r)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(_bits(out), _bits(finalize_ref(y, w, t2r)))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = finalize_cuda(y, w, t2r)
    for seed in (7, 8):
        y2, w2, t2r2 = finalize_case(64, 8, 7168, seed=seed)  # M_cap is a static bound: same shapes
        y.copy_(y2)
        w.copy_(w2)
        t2r.copy_(t2r2)
        out_g.fill_(float("nan"))
        graph.replay()
        assert torch.equal(_bits(out_g), _bits(finalize_ref(y, w, t2r)))


# ----------------------------------------------------------------------------- moe_reduce


def moe_reduce_case(T, k, H, dtype, seed, *, row_pad=0, device="cuda"):
    """hidden [T, k, H] (a slice of [T, k, H + row_pad] whose pad is NaN), weights [T, k] f32."""
    g = _gen(seed, device)
    # Built in the row dtype (the same values as an f32 buffer cast to it, without its f32 copy)
    buf = torch.full((T, k, H + row_pad), float("nan"), dtype=dtype, device=device)
    rows = _rows(T * k, H, g, device).reshape(T, k, H)
    if dtype == torch.float16:
        rows.clamp_(-6e4, 6e4)
    buf[:, :, :H] = rows.to(dtype)
    return buf[:, :, :H], _weights(T, k, g, device)


def _check_moe_reduce(hidden, weights, fp32_acc):
    out_bytes = hidden.shape[0] * hidden.shape[2] * hidden.element_size()
    out, ref = _run(lambda: moe_reduce_cuda(hidden, weights, fp32_acc), lambda: moe_reduce_ref(hidden, weights, fp32_acc),
                    hidden.dtype, "a pad column", out_bytes)  # fmt: skip
    assert torch.equal(_bits(out), _bits(ref)), (out.double() - ref.double()).abs().max()


@pytest.mark.parametrize("fp32_acc", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("T", TOKENS)
def test_moe_reduce(T, k, H, dtype, fp32_acc):
    seed = T * 1013 + k * 37 + H + 2 * fp32_acc + {torch.bfloat16: 0, torch.float16: 5, torch.float32: 9}[dtype]
    _check_moe_reduce(*moe_reduce_case(T, k, H, dtype, seed, row_pad=64 if T == 7 else 0), fp32_acc)


@pytest.mark.parametrize("fp32_acc", [True, False])
def test_moe_reduce_65536_tokens(fp32_acc):
    """T = 65536 tokens (the grid's x dimension past 65535) at k = 8, H = 2048, bf16: hidden is
    2**31 bytes (2 GiB).  GPU memory: hidden 2.1 GB, the case's f32 draw 4.3 GB and its bf16 copy
    2.1 GB (transient); peak ~9 GB, a few seconds."""
    _check_moe_reduce(*moe_reduce_case(65536, 8, 2048, torch.bfloat16, seed=65536 + fp32_acc), fp32_acc)


@pytest.mark.parametrize("k", [16, 32])
def test_moe_reduce_large_topk(k):
    _check_moe_reduce(*moe_reduce_case(100, k, 2048, torch.bfloat16, seed=k), True)


def test_moe_reduce_top1_column_weights_and_zero_topk():
    hidden, w = moe_reduce_case(33, 1, 4096, torch.bfloat16, seed=11)
    _check_moe_reduce(hidden, w.as_strided((33, 1), (1, 3)), True)
    out = moe_reduce_cuda(hidden[:, :0], w[:, :0], False)
    assert out.shape == (33, 4096) and torch.all(out == 0)


def test_moe_reduce_rejects_unsupported_layouts():
    hidden, w = moe_reduce_case(4, 2, 2048 + 8, torch.bfloat16, seed=12)
    with pytest.raises(ValueError, match="hidden"):
        moe_reduce_cuda(hidden[:, :, 4:4 + 2048], w, True)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        moe_reduce_cuda(hidden[:, :, :2044], w, True)
    with pytest.raises(NotImplementedError, match="multiple of 4"):
        moe_reduce_cuda(hidden.float()[:, :, :2046], w, True)


def test_moe_reduce_cuda_graph():
    hidden, w = moe_reduce_case(16, 8, 7168, torch.bfloat16, seed=13)
    moe_reduce_cuda(hidden, w, True)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = moe_reduce_cuda(hidden, w, True)
    for seed in (14, 15):
        h2, w2 = moe_reduce_case(16, 8, 7168, torch.bfloat16, seed=seed)
        hidden.copy_(h2)
        w.copy_(w2)
        out_g.fill_(float("nan"))
        graph.replay()
        assert torch.equal(_bits(out_g), _bits(moe_reduce_ref(hidden, w, True)))
