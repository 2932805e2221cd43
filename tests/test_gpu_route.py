"""route's CuTe DSL kernel against ``reference.route_ref``, on the GPU.

``route_cuda`` is called directly on fresh random logits (never zeros), its outputs
allocated from a NaN-poisoned allocator (unwritten ids read as -1, unwritten weights as
NaN), and compared with the reference computed by torch on the same device:

* ids exactly, in the reference's order (descending key, ties to the lower expert);
* weights within 1e-5 relative (the kernel's sums run in another order than torch's).

Ties are planted on purpose: repeated values inside a row (including a repeated
maximum), bf16 logits (many natural repeats), rows whose sigmoid saturates to exactly
1.0 (every key of sigmoid_renorm / deepseek_v3 ties there), equal group scores, and
all-equal rows.  Matching the reference on the sigmoid and softmax keys bit for bit
relies on the kernel's exp being the same as torch's ``std::exp`` (libdevice-class
expf, fastmath off) and its divisions being correctly rounded:
``test_sigmoid_bits`` checks that assumption directly, so a failure there explains
id mismatches elsewhere.
"""

import zlib

import pytest
import torch

from cute_moe.kernels.route import RouteKernel, route_cuda
from cute_moe.reference import route_ref

from .gpu_helpers import poison_allocator

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 128, 4096, 65536]
EXPERTS = [8, 64, 128, 256, 384, 512]
TOPK = [1, 2, 6, 8]
DTYPES = [torch.float32, torch.bfloat16]
PLAIN_METHODS = ["softmax", "renormalize", "llama4", "sigmoid_renorm"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _logits(T: int, E: int, dtype: torch.dtype, seed: int, *, plant_ties: bool = True) -> torch.Tensor:
    """N(0, 2^2) logits with planted repeats: E/8 copied columns per row and a repeated maximum;
    every 16th row is shifted by +20 (sigmoid saturates to 1.0 there: all sigmoid keys tie)."""
    g = _gen(seed)
    x = torch.randn(T, E, generator=g, device="cuda") * 2.0
    if plant_ties and E > 1:
        n = max(1, E // 8)
        dst = torch.randint(0, E, (T, n), generator=g, device="cuda")
        src = torch.randint(0, E, (T, n), generator=g, device="cuda")
        x.scatter_(1, dst, x.gather(1, src))
        x.scatter_(1, torch.randint(0, E, (T, 1), generator=g, device="cuda"), x.amax(1, keepdim=True))
        x[::16] += 20.0
    return x.to(dtype)


def _bias(E: int, seed: int) -> torch.Tensor:
    return torch.randn(E, generator=_gen(seed), device="cuda") * 0.05


def _check(logits, k, method, bias=None, n_group=1, topk_group=1, rsf=1.0):
    poison_allocator()
    ids, w = route_cuda(logits, k, method, bias, n_group, topk_group, rsf)
    ref_ids, ref_w = route_ref(logits, k, method, bias, n_group, topk_group, rsf)
    T = logits.shape[0]
    assert ids.shape == w.shape == (T, k) and ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.is_contiguous() and w.is_contiguous()
    assert not w.isnan().any(), "a weight was left unwritten"
    assert bool(((ids >= 0) & (ids < logits.shape[1])).all()), "an id was left unwritten or is out of range"
    bad = (ids != ref_ids).any(dim=1)
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} of {T} rows differ from the reference; first: row {t}: "
            f"kernel {ids[t].tolist()} vs reference {ref_ids[t].tolist()}"
        )
    # atol only for quotients in the subnormal range, where 1e-5 relative is below one step
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-37)


def _seed(*parts) -> int:
    """A reproducible seed from the case's parameters (str hashes vary per process)."""
    return zlib.crc32(repr(parts).encode()) % (2**31)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", TOPK)
@pytest.mark.parametrize("E", EXPERTS)
@pytest.mark.parametrize("method", PLAIN_METHODS)
def test_route_plain(method, E, k, dtype):
    if k > E:
        pytest.skip("k > E")
    for T in TOKENS:
        rsf = 1.0 if T % 2 else 2.5
        _check(_logits(T, E, dtype, _seed(method, E, k, dtype, T)), k, method, rsf=rsf)


def _deepseek_cases():
    """(E, k, n_group, topk_group): DeepSeek-V3 shapes, Kimi K2 (n_group = 1), every lane layout."""
    cases = []
    for E in EXPERTS:
        for k in TOPK:
            cases.append((E, k, 1, 1))  # no grouping (Kimi K2: E=384, k=8)
            if E % 8 == 0 and k <= 4 * (E // 8):
                cases.append((E, k, 8, 4))  # DeepSeek-V3 grouping
    cases += [
        (8, 2, 4, 2),  # 2 experts per group, a group spans 2 lanes
        (8, 3, 8, 3),  # 1 expert per group: group score = top-1
        (64, 6, 16, 5),
        (256, 8, 32, 8),  # 8 experts per group: one group per lane
        (384, 8, 16, 5),  # 24 experts per group over 2 lanes of 12
        (384, 8, 64, 8),  # 6 experts per group, 2 groups per lane
        (512, 8, 64, 8),  # 8 experts per group, 2 groups per lane
        (512, 8, 2, 1),  # 256 experts per group over 16 lanes
        (256, 8, 8, 8),  # every group kept: grouping compiled out
    ]
    return cases


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E,k,n_group,topk_group", _deepseek_cases())
def test_route_deepseek_v3(E, k, n_group, topk_group, dtype, bias):
    assert RouteKernel.can_implement("deepseek_v3", E, k, n_group, topk_group, dtype, bias) is None
    for T in TOKENS:
        seed = _seed("ds", E, k, n_group, topk_group, dtype, bias, T)
        b = _bias(E, seed + 1) if bias else None
        _check(_logits(T, E, dtype, seed), k, "deepseek_v3", b, n_group, topk_group, 2.5)


@pytest.mark.parametrize("method", PLAIN_METHODS + ["deepseek_v3"])
def test_route_all_equal_rows(method):
    # Every key ties (and every group score ties): ids 0..k-1, groups 0..topk_group-1.
    kw = dict(n_group=8, topk_group=4) if method == "deepseek_v3" else {}
    for value in (0.0, 1.5, -3.0, 30.0):
        logits = torch.full((33, 256), value, device="cuda")
        _check(logits, 8, method, rsf=3.0, **kw)
        _check(logits.bfloat16(), 8, method, **kw)


def test_route_deepseek_v3_tied_groups():
    # Groups 1, 3, 5 and 6 have equal scores, built from different experts; bias ties too.
    E, ng = 256, 8
    g = _gen(5)
    x = torch.randn(64, E, generator=g, device="cuda") - 4.0
    for grp, (a, b) in {1: (3, 30), 3: (0, 31), 5: (17, 18), 6: (1, 2)}.items():
        x[:, grp * 32 + a] = 3.0
        x[:, grp * 32 + b] = 2.0
    bias = torch.zeros(E, device="cuda")
    _check(x, 8, "deepseek_v3", bias, ng, 4, 1.0)
    _check(x, 8, "deepseek_v3", bias, ng, 3, 1.0)
    _check(x, 2, "deepseek_v3", None, ng, 1, 1.0)


def test_route_wide_topk():
    # top_k up to 32 for the methods other than deepseek_v3.
    for method in PLAIN_METHODS:
        for E, k in ((32, 32), (64, 32), (512, 32), (384, 17)):
            for dtype in DTYPES:
                _check(_logits(1000, E, dtype, _seed("wide", method, E, k, dtype)), k, method, rsf=0.5)


def test_route_odd_expert_counts():
    # E not a multiple of 32: lanes past E hold -inf keys.
    for method in PLAIN_METHODS:
        for E, k in ((1, 1), (3, 2), (50, 6), (100, 8), (500, 8)):
            _check(_logits(300, E, torch.float32, _seed("odd", method, E)), k, method)
    _check(_logits(300, 100, torch.bfloat16, 9), 8, "deepseek_v3", _bias(100, 9), 4, 2, 2.5)


def test_route_strided_and_misaligned_logits():
    # A column slice of a wider buffer (row stride E + 3, base not 16-byte aligned): the
    # launcher routes a contiguous copy; the result must not change.
    E, k = 256, 8
    buf = _logits(513, E + 3, torch.float32, 11)
    logits = buf[:, 1 : E + 1]
    bias = torch.empty(E + 1, device="cuda")[1:].copy_(_bias(E, 12))  # misaligned bias
    _check(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
    _check(logits.bfloat16(), k, "renormalize")
    _check(buf.bfloat16()[:, 1 : E + 1], k, "softmax")


def test_route_empty_and_one_token():
    ids, w = route_cuda(torch.empty(0, 256, device="cuda"), 8, "deepseek_v3", _bias(256, 1), 8, 4, 2.5)
    assert ids.shape == w.shape == (0, 8) and ids.dtype == torch.int32
    _check(_logits(1, 256, torch.float32, 3), 8, "deepseek_v3", _bias(256, 4), 8, 4, 2.5)


def test_sigmoid_bits():
    # The kernel's sigmoid is torch's to the bit (1 / (1 + exp(-x)), expf, correctly rounded
    # division): llama4 with k=1 and scale 1 returns sigmoid(max logit) itself.
    x = torch.randn(65536, 8, device="cuda") * 8.0
    ids, w = route_cuda(x, 1, "llama4", None, 1, 1, 1.0)
    want = torch.sigmoid(x.gather(1, ids.long()))
    assert torch.equal(w.view(torch.int32), want.view(torch.int32)), (w - want).abs().max()
    # sigmoid_renorm with k=1: weight s/s = 1 exactly; ids follow torch's sigmoid keys
    _check(x, 1, "sigmoid_renorm")


def test_route_side_stream_and_cuda_graph():
    E, k = 256, 8
    logits = _logits(64, E, torch.float32, 21)
    bias = _bias(E, 22)
    route_cuda(logits, k, "deepseek_v3", bias, 8, 4, 2.5)  # compile before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ids, w = route_cuda(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
    torch.cuda.current_stream().wait_stream(stream)
    ref_ids, ref_w = route_ref(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-37)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_g, w_g = route_cuda(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
    for seed in (23, 24):
        logits.copy_(_logits(64, E, torch.float32, seed))
        ids_g.fill_(-1)
        w_g.fill_(float("nan"))
        graph.replay()
        ref_ids, ref_w = route_ref(logits, k, "deepseek_v3", bias, 8, 4, 2.5)
        assert torch.equal(ids_g, ref_ids)
        torch.testing.assert_close(w_g, ref_w, rtol=1e-5, atol=1e-37)
