"""CPU tests of cute_moe.reference: every reference against a deliberately naive
Python-loop implementation written here, plus hand-worked cases.

Tolerances (stated per test): quantization codes are compared bit for bit
(``.view(torch.uint8)``) because the naive loops use the same f32 formula, with a
hand-written e4m3 encoder instead of torch's cast; scales compare exactly; f32 sums
of a few terms allow ~1e-5 relative; bf16 outputs allow one bf16 rounding (2**-8).
Random data comes from seeded ``torch.Generator``s and is never all zeros.
"""

import math
import struct

import pytest
import torch
import torch.nn.functional as F

from cute_moe import reference as R

FP8 = torch.float8_e4m3fn
F32_FLOOR = struct.unpack("f", struct.pack("f", 1e-6))[0]  # 1e-6 as an f32 value


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def f32(v: float) -> float:
    """Round a Python float to the nearest f32 value."""
    return struct.unpack("f", struct.pack("f", v))[0]


# ----------------------------------------------------------------------------- naive quantization


def fp8_code(v: float) -> int:
    """Naive float8_e4m3fn encoder, round to nearest even; |v| <= 448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a < 2.0**-6:  # subnormal: multiples of 2**-9 (m == 8 is the smallest normal, same bits)
        return sign | round(a * 2**9)
    e = math.frexp(a)[1] - 1  # a = 1.f * 2**e
    m = round((a / 2.0**e - 1.0) * 8)
    if m == 8:
        e, m = e + 1, 0
    return sign | ((e + 7) << 3) | m


def naive_quant_row(vals, group_size, scale_fmt):
    """One row: (codes, scales) with the spec's per-group f32 formula, element by element."""
    codes, scales = [], []
    for g0 in range(0, len(vals), group_size):
        grp = vals[g0 : g0 + group_size]
        amax = max(max(abs(v) for v in grp), F32_FLOOR)
        scale = f32(amax / 448.0)
        if scale_fmt == "ue8m0":
            scale = 2.0 ** math.ceil(math.log2(scale))
        scales.append(scale)
        codes += [fp8_code(max(-448.0, min(448.0, f32(v / scale)))) for v in grp]
    return codes, scales


def naive_quant(x, group_size=128, scale_fmt=None):
    out = [naive_quant_row(row, group_size, scale_fmt) for row in x.float().tolist()]
    return [c for c, _ in out], [s for _, s in out]


def codes_of(q):
    return q.view(torch.uint8).tolist()


def zero_row_scale(scale_fmt):
    return naive_quant_row([0.0], 1, scale_fmt)[1][0]


# ----------------------------------------------------------------------------- quant_fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quant_fp8_vs_naive(dtype, group_size, scale_fmt):
    # rows spread over 6 decades so scales cover many binades; codes and scales exact
    M, K = 6, 256
    x = randn(M, K, seed=1) * torch.logspace(-3, 3, M)[:, None]
    x = x.to(dtype)
    q, s = R.quant_fp8_ref(x, group_size, scale_fmt)
    codes, scales = naive_quant(x, group_size, scale_fmt)
    assert q.dtype == FP8 and q.shape == (M, K)
    assert s.dtype == torch.float32 and s.shape == (M, K // group_size) and s.stride() == (K // group_size, 1)
    assert codes_of(q) == codes
    assert s.tolist() == scales


def test_quant_fp8_column_major_scales():
    x = randn(5, 256, seed=2)
    q, s = R.quant_fp8_ref(x, column_major_scales=True)
    q2, s2 = R.quant_fp8_ref(x)
    assert s.shape == (5, 2) and s.stride() == (1, 5)
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_quant_fp8_known_codes():
    # group 0: amax = 448 -> scale = 1.0 exactly, so the codes are the e4m3 encodings of x:
    #   448 = 1.75*2^8 -> 0|1111|110 = 0x7E;  -448 -> 0xFE;  1.0 -> 0|0111|000 = 0x38;  0.5 -> 0x30;
    #   1.0625 is halfway 1.0/1.125 -> even mantissa 000 -> 0x38;  1.1875 halfway 1.125/1.25 -> 010 -> 0x3A;
    #   2^-9 is the smallest subnormal -> 0x01;  -2.0 -> 1|1000|000 = 0xC0;  3.0 = 1.5*2 -> 0|1000|100 = 0x44;
    #   432 is halfway 416 (m=101) / 448 (m=110) -> even -> 448 = 0x7E.
    # group 1: amax = 7 -> scale = 7/448 = 2^-6 exactly:  7 -> 448 -> 0x7E;  3.5 -> 224 = 1.75*2^7 -> 0x76;
    #   -1.75 -> -112 = -1.75*2^6 -> 1|1101|110 = 0xEE.
    g0 = [448.0, -448.0, 1.0, 0.5, 1.0625, 1.1875, 2.0**-9, -2.0, 3.0, 432.0]
    g1 = [7.0, 3.5, -1.75]
    x = torch.zeros(1, 256)
    x[0, : len(g0)] = torch.tensor(g0)
    x[0, 128 : 128 + len(g1)] = torch.tensor(g1)
    q, s = R.quant_fp8_ref(x)
    codes = codes_of(q)[0]
    assert codes[: len(g0)] == [0x7E, 0xFE, 0x38, 0x30, 0x38, 0x3A, 0x01, 0xC0, 0x44, 0x7E]
    assert codes[128 : 128 + len(g1)] == [0x7E, 0x76, 0xEE]
    assert set(codes[len(g0) : 128] + codes[128 + len(g1) :]) == {0}
    assert s.tolist() == [[1.0, 2.0**-6]]
    assert [fp8_code(v) for v in g0] == codes[: len(g0)]  # the naive encoder agrees


def test_quant_ue8m0_scales_are_powers_of_two():
    # exact check of the spec: scale = 2**ceil(log2(amax/448)) -> a power of two, the smallest with
    # amax/scale <= 448. Includes amax/448 exactly a power of two (56/448 = 2^-3 -> stays 0.125; 2^-20
    # stays) and one ulp above it (-> 0.25; -> 2^-19); f32 log2 of the latter rounds to exactly -20.
    x = randn(8, 512, seed=3) * torch.logspace(-5, 4, 8)[:, None]
    up = torch.tensor(1e9)
    for row, pow2 in ((0, 56.0), (1, 448 * 2.0**-20)):
        x[row, :256] = pow2 / 8
        x[row, 0] = pow2
        x[row, 128] = torch.nextafter(torch.tensor(pow2), up)
    q, s = R.quant_fp8_ref(x, scale_fmt="ue8m0")
    _, plain = R.quant_fp8_ref(x)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)
    amax = x.reshape(8, 4, 128).abs().amax(-1)
    assert torch.all(amax / s <= 448.0) and torch.all(s >= plain) and torch.all(s / 2 < plain)
    assert s[0, :2].tolist() == [0.125, 0.25] and s[1, :2].tolist() == [2.0**-20, 2.0**-19]
    assert torch.all(q.float().abs() <= 448.0)


def test_quant_zero_group():
    # an all-zero group: amax floors at 1e-6 -> codes 0, scale = f32(1e-6)/448 (or its ue8m0 rounding)
    x = torch.cat([torch.zeros(1, 128), randn(1, 128, seed=4)], dim=1)
    for fmt in (None, "ue8m0"):
        q, s = R.quant_fp8_ref(x, scale_fmt=fmt)
        assert codes_of(q)[0][:128] == [0] * 128
        assert s[0, 0].item() == zero_row_scale(fmt)


def test_quant_rejects_bad_args():
    with pytest.raises(ValueError):
        R.quant_fp8_ref(randn(2, 100, seed=5))
    with pytest.raises(ValueError):
        R.quant_fp8_ref(randn(2, 128, seed=5), scale_fmt="e8m0")


def test_constants():
    assert R.FP8_MAX == 448.0 and R.FP8_DTYPE is FP8


# ----------------------------------------------------------------------------- 128x128 weight blocks


def test_block_128x128_vs_naive():
    # codes exact vs a per-block loop; dequant within half an e4m3 ulp (2^-4 relative) + subnormal step
    E, N, K = 2, 200, 256
    w = randn(E, N, K, seed=6, dtype=torch.bfloat16, scale=0.05)
    q, s = R.quant_block_128x128_ref(w)
    assert q.shape == (E, N, K) and q.dtype == FP8 and s.shape == (E, 2, 2) and s.dtype == torch.float32
    wf = w.float()
    for e in range(E):
        for nb in range(2):
            for kb in range(2):
                blk = wf[e, nb * 128 : (nb + 1) * 128, kb * 128 : (kb + 1) * 128]
                scale = f32(max(blk.abs().max().item(), F32_FLOOR) / 448.0)
                assert s[e, nb, kb].item() == scale
                qb = q[e, nb * 128 : (nb + 1) * 128, kb * 128 : (kb + 1) * 128]
                want = [[fp8_code(max(-448.0, min(448.0, f32(v / scale)))) for v in row] for row in blk.tolist()]
                assert codes_of(qb) == want
    deq = R.dequant_block_128x128_ref(q, s)
    step = s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)
    assert torch.all((deq - wf).abs() <= wf.abs() * 2.0**-4 + step * 2.0**-9)
    with pytest.raises(ValueError):
        R.quant_block_128x128_ref(torch.ones(4, 100))


def test_dequant_block_128x128_whole_blocks():
    """Whole 128 x 128 blocks (the scales broadcast): every element is its code times its block's
    scale, as with expanded scales (N = 200 above takes the expanding path), batched and on a
    transposed view; scales of the wrong shape are refused, not broadcast."""
    w = randn(3, 256, 384, seed=7, dtype=torch.float32, scale=0.05)
    q, s = R.quant_block_128x128_ref(w)
    want = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert torch.equal(R.dequant_block_128x128_ref(q, s), want)
    assert torch.equal(R.dequant_block_128x128_ref(q[1].t(), s[1].t()), want[1].t())
    with pytest.raises(ValueError, match=r"scale must be \[\.\.\., N/128, K/128\] = \[\.\.\., 2, 3\]"):
        R.dequant_block_128x128_ref(q, s[:, :1])


# ----------------------------------------------------------------------------- route


def naive_route(logits, top_k, method, bias=None, n_group=1, topk_group=1, rsf=1.0):
    """Per-token loops; f32 elementwise scores via torch, selection/normalisation in Python."""
    T, E = logits.shape
    ids_all, w_all = [], []
    for t in range(T):
        row = logits[t].float()
        lg = row.tolist()

        def pick(score, cand=range(E)):
            return sorted(cand, key=lambda e: (-score[e], e))[:top_k]

        if method == "softmax":
            p = torch.softmax(row, 0).tolist()
            ids = pick(p)
            w = [p[e] for e in ids]
        elif method == "renormalize":
            ids = pick(lg)
            ex = [math.exp(lg[e] - lg[ids[0]]) for e in ids]
            w = [v / sum(ex) for v in ex]
        elif method == "llama4":
            ids = pick(lg)
            w = [1.0 / (1.0 + math.exp(-lg[e])) for e in ids]
        elif method == "sigmoid_renorm":
            s = torch.sigmoid(row).tolist()
            ids = pick(s)
            w = [s[e] / sum(s[i] for i in ids) for e in ids]
        else:
            s_t = torch.sigmoid(row)
            s = s_t.tolist()
            c = (s_t + bias).tolist() if bias is not None else s
            gsz = E // n_group
            gscore = [sum(sorted(c[g * gsz : (g + 1) * gsz], reverse=True)[:2]) for g in range(n_group)]
            kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            ids = pick(c, [e for e in range(E) if e // gsz in kept])
            w = [s[e] / sum(s[i] for i in ids) for e in ids]
        ids_all.append(ids)
        w_all.append([v * rsf for v in w])
    return torch.tensor(ids_all, dtype=torch.int32).reshape(T, top_k), torch.tensor(w_all).reshape(T, top_k)


ROUTE_CASES = [
    ("softmax", 4, {}),
    ("renormalize", 4, {}),
    ("llama4", 1, {}),
    ("llama4", 3, {}),
    ("sigmoid_renorm", 4, {}),
    ("deepseek_v3", 4, dict(n_group=4, topk_group=2, rsf=2.5, bias=True)),
    ("deepseek_v3", 3, dict(n_group=8, topk_group=3, rsf=1.0)),
    ("deepseek_v3", 4, dict(n_group=16, topk_group=5, rsf=1.0, bias=True)),  # 1 expert per group: top-1 score
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,top_k,kw", ROUTE_CASES)
def test_route_vs_naive(method, top_k, kw, dtype):
    # ids exact (bf16 logits produce real ties); weights rtol 1e-5 (f32 vs double normalisation)
    T, E = 9, 16
    logits = randn(T, E, seed=7, dtype=dtype, scale=2.0)
    kw = dict(kw)
    bias = randn(E, seed=8, scale=0.3) if kw.pop("bias", False) else None
    rsf = kw.pop("rsf", 1.0)
    ids, w = R.route_ref(logits, top_k, method, bias, routed_scaling_factor=rsf, **kw)
    nids, nw = naive_route(logits, top_k, method, bias, rsf=rsf, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (T, top_k)
    assert torch.equal(ids, nids)
    torch.testing.assert_close(w, nw, rtol=1e-5, atol=1e-7)


def test_route_deepseek_v3_hand():
    # E=8, n_group=4 (2 experts/group), topk_group=2, top_k=2, routed_scaling_factor=2.5.
    # Logits are logit(s) so sigmoid gives s back (to ~1 f32 ulp).
    # bias = [-.60, 0, .05, 0, .45, 0, 0, .10]
    # token 0: s = [.90, .10, .60, .50, .30, .70, .80, .20]
    #   c = s + bias = [.30, .10, .65, .50, .75, .70, .80, .30]
    #   group scores (top-2 sums): g0 .40, g1 1.15, g2 1.45, g3 1.10 -> keep g2, g1 (g3 dropped even though
    #   expert 6 has the best c; expert 0 has the best s but its bias sinks it)
    #   kept c: e2 .65, e3 .50, e4 .75, e5 .70 -> ids [4, 5]; w = s/sum = [.3, .7] * 2.5 = [0.75, 1.75]
    # token 1: s = [.20, .25, .95, .05, .40, .45, .30, .60]
    #   c = [-.40, .25, 1.00, .05, .85, .45, .30, .70]
    #   group scores: g0 -.15, g1 1.05, g2 1.30, g3 1.00 -> keep g2, g1
    #   kept c: e2 1.00, e3 .05, e4 .85, e5 .45 -> ids [2, 4]; w = [.95, .40]/1.35*2.5 = [2.375/1.35, 1/1.35]
    s = torch.tensor(
        [[0.90, 0.10, 0.60, 0.50, 0.30, 0.70, 0.80, 0.20], [0.20, 0.25, 0.95, 0.05, 0.40, 0.45, 0.30, 0.60]]
    )
    logits = torch.log(s / (1 - s))
    bias = torch.tensor([-0.60, 0.0, 0.05, 0.0, 0.45, 0.0, 0.0, 0.10])
    ids, w = R.route_ref(logits, 2, "deepseek_v3", bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert ids.tolist() == [[4, 5], [2, 4]]
    torch.testing.assert_close(w, torch.tensor([[0.75, 1.75], [2.375 / 1.35, 1 / 1.35]]), rtol=1e-6, atol=1e-6)


def test_route_ties_go_to_lower_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, -1.0, 3.0]])
    for method in ("softmax", "renormalize", "llama4", "sigmoid_renorm", "deepseek_v3"):
        ids, w = R.route_ref(logits, 3, method)
        assert ids.tolist() == [[1, 2, 4]], method
    # equal groups too: all scores 0.5 -> groups 0 and 1 kept, experts 0 and 1 chosen, weights 0.5 each
    ids, w = R.route_ref(torch.zeros(2, 8), 2, "deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=3.0)
    assert ids.tolist() == [[0, 1], [0, 1]]
    assert w.tolist() == [[1.5, 1.5], [1.5, 1.5]]
    ids, _ = R.route_ref(torch.zeros(1, 8), 3, "deepseek_v3", n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2]]


def test_route_t0_and_errors():
    ids, w = R.route_ref(torch.zeros(0, 8), 2, "deepseek_v3", torch.ones(8), n_group=4, topk_group=2)
    assert ids.shape == w.shape == (0, 2) and ids.dtype == torch.int32
    with pytest.raises(ValueError):
        R.route_ref(torch.zeros(1, 8), 2, "topk")
    with pytest.raises(ValueError):
        R.route_ref(torch.zeros(1, 8), 2, "softmax", torch.zeros(8))


# ----------------------------------------------------------------------------- align


def naive_align(topk_ids, num_experts, alignment=128, expert_offset=0, num_local_experts=None):
    E = num_experts if num_local_experts is None else num_local_experts
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).tolist()
    members = [[] for _ in range(E)]
    for i, eid in enumerate(flat):
        if 0 <= eid - expert_offset < E:
            members[eid - expert_offset].append(i)
    offsets = [0]
    for m in members:
        offsets.append(offsets[-1] + (len(m) + alignment - 1) // alignment * alignment)
    n = T * k
    mcap = 0 if T == 0 else (n + min(n, E) * (alignment - 1) + alignment - 1) // alignment * alignment
    r2t, t2r = [-1] * mcap, [-1] * n
    for e, m in enumerate(members):
        for rank, i in enumerate(m):
            r2t[offsets[e] + rank] = i // k
            t2r[i] = offsets[e] + rank
    return offsets, r2t, t2r, [len(m) for m in members]


ALIGN_CASES = [  # T, k, num_experts, alignment, expert_offset, num_local_experts, experts drawn from
    (13, 4, 8, 4, 0, None, 8),
    (13, 4, 16, 8, 4, 6, 16),  # EP: local experts 4..9
    (9, 2, 8, 128, 6, 2, 8),  # last EP rank
    (1, 8, 256, 128, 0, None, 256),  # decode
    (20, 3, 12, 16, 0, None, 5),  # experts 5..11 empty
    (7, 3, 12, 1, 2, 8, 12),  # alignment 1
]


@pytest.mark.parametrize("T,k,E,a,off,E_local,draw", ALIGN_CASES)
def test_align_vs_naive(T, k, E, a, off, E_local, draw):
    ids = torch.stack([torch.randperm(draw, generator=gen(100 + t))[:k] for t in range(T)]).to(torch.int32)
    got = R.align_ref(ids, E, a, off, E_local)
    want = naive_align(ids, E, a, off, E_local)
    El = E if E_local is None else E_local
    shapes = [(El + 1,), (R.m_cap(T, k, El, a),), (T, k), (El,)]
    for g, w, shape in zip(got, want, shapes):
        assert g.dtype == torch.int32 and tuple(g.shape) == shape
        assert g.reshape(-1).tolist() == w


def test_align_hand():
    # ids [[2,0],[2,1],[0,2]], E=4, alignment=2: counts [2,1,3,0], padded [2,2,4,0], offsets [0,2,4,8,8]
    # expert 0 <- flat 1 (t0), 4 (t2): rows 0,1;  expert 1 <- flat 3 (t1): row 2, row 3 pad;
    # expert 2 <- flat 0,2,5 (t0,t1,t2): rows 4,5,6, row 7 pad;  M_cap = round_up(6 + 4*1, 2) = 10
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    off, r2t, t2r, cnt = R.align_ref(ids, 4, alignment=2)
    assert off.tolist() == [0, 2, 4, 8, 8]
    assert r2t.tolist() == [0, 2, 1, -1, 0, 1, 2, -1, -1, -1]
    assert t2r.tolist() == [[4, 0], [5, 2], [1, 6]]
    assert cnt.tolist() == [2, 1, 3, 0]


def test_align_t0_and_all_nonlocal():
    off, r2t, t2r, cnt = R.align_ref(torch.zeros(0, 4, dtype=torch.int32), 8, 128, 2, 3)
    assert off.tolist() == [0] * 4 and r2t.shape == (0,) and t2r.shape == (0, 4) and cnt.tolist() == [0] * 3
    ids = torch.tensor([[0, 1], [7, 6]], dtype=torch.int32)  # none in local range 2..4
    off, r2t, t2r, cnt = R.align_ref(ids, 8, 128, 2, 3)
    assert off.tolist() == [0] * 4 and r2t.tolist() == [-1] * 512 and t2r.tolist() == [[-1, -1], [-1, -1]]


def test_align_rejects_out_of_range():
    for bad in (8, -2):
        with pytest.raises(ValueError, match=r"topk_ids must be -1 or lie in \[0, num_experts\)"):
            R.align_ref(torch.tensor([[0, bad]], dtype=torch.int32), 8)


def test_align_takes_masked_slots():
    """-1 (vLLM's expert map for another rank's expert) is not local, as on the GPU: the same segments
    as the slot routed to a non-local expert, and -1 in token_to_row."""
    ids = torch.tensor([[0, -1], [3, 1], [-1, -1]], dtype=torch.int32)
    off, r2t, t2r, counts = R.align_ref(ids, 8, 4, expert_offset=0, num_local_experts=4)
    ref = R.align_local(torch.where(ids < 0, 7, ids), 4, 4, 0)
    for got, want in zip((off, r2t, t2r, counts), ref):
        assert torch.equal(got, want)
    assert t2r[0, 1] == -1 and bool((t2r[2] == -1).all())


def test_m_cap_ints_and_symints():
    assert R.m_cap(0, 8, 256, 128) == 0
    assert R.m_cap(1, 8, 256, 128) == 1024
    assert R.m_cap(100, 8, 16, 128) == 2944  # 800 + 16*127 = 2832 -> next multiple of 128
    assert R.m_cap(3, 2, 4, 1) == 6

    def fn(x):  # under dynamic=True, x.shape[0] is a SymInt
        return x.new_zeros(R.m_cap(x.shape[0], 8, 256, 128))

    compiled = torch.compile(fn, dynamic=True, backend="eager", fullgraph=True)
    for T in (3, 5, 40):
        assert compiled(torch.zeros(T, 2)).shape == (R.m_cap(T, 8, 256, 128),)


# ----------------------------------------------------------------------------- permute_quant / permute


def routed_layout(T=6, k=2, E=4, alignment=8, seed=11):
    ids = torch.stack([torch.randperm(E, generator=gen(seed + t))[:k] for t in range(T)]).to(torch.int32)
    return R.align_ref(ids, E, alignment)


def mn_major(s):
    return s.stride() == (1, s.shape[0])


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant_vs_naive(scale_fmt):
    # codes and scales exact; padding rows: codes 0, scale of an all-zero row
    off, r2t, _, _ = routed_layout()
    x = randn(6, 256, seed=12, dtype=torch.bfloat16)
    a, s = R.permute_quant_ref(x, r2t, off, scale_fmt)
    M = r2t.shape[0]
    assert a.shape == (M, 256) and a.dtype == FP8 and s.shape == (M, 2) and mn_major(s)
    codes, scales = codes_of(a), s.tolist()
    for r in range(off[-1].item()):
        t = r2t[r].item()
        if t >= 0:
            want = naive_quant_row(x[t].float().tolist(), 128, scale_fmt)
        else:
            want = ([0] * 256, [zero_row_scale(scale_fmt)] * 2)
        assert (codes[r], scales[r]) == want, r


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_permute_quant_ignores_token_to_row(scale_fmt):
    # token_to_row only tells a kernel where each token goes; the result is row_to_token's
    off, r2t, t2r, _ = R.align_ref(torch.tensor([[0, 3], [5, 1], [3, 2], [7, 0]], dtype=torch.int32), 8, 4, 2, 4)
    assert bool((t2r == -1).any())  # experts 0, 1, 7 are not local
    x = randn(4, 256, seed=15, dtype=torch.bfloat16)
    a, s = R.permute_quant_ref(x, r2t, off, scale_fmt)
    for t2r_given in (t2r, t2r.long()):
        a2, s2 = R.permute_quant_ref(x, r2t, off, scale_fmt, t2r_given)
        assert codes_of(a2) == codes_of(a) and torch.equal(s2, s) and s2.stride() == s.stride()


def test_permute_quant_rejects_a_token_to_row_that_is_not_the_inverse():
    # the CUDA kernel trusts token_to_row (a row it does not name stays unwritten): the reference checks it
    off, r2t, t2r, _ = R.align_ref(torch.tensor([[0, 3], [5, 1], [3, 2], [7, 0]], dtype=torch.int32), 8, 4, 2, 4)
    x = randn(4, 256, seed=16, dtype=torch.bfloat16)
    swapped = t2r.clone()
    swapped[[0, 2]] = swapped[[2, 0]]  # rows named by the wrong tokens
    dropped = t2r.clone()
    dropped[dropped >= 0] = -1  # no row named at all
    for bad in (swapped, dropped, torch.full_like(t2r, 10**6)):
        with pytest.raises(ValueError, match="token_to_row must be the inverse of row_to_token"):
            R.permute_quant_ref(x, r2t, off, None, bad)


def test_permute_vs_naive():
    # codes and scales copied exactly; padding rows: codes 0, scale 1.0; input scales may be column-major
    off, r2t, _, _ = routed_layout(seed=13)
    q, s_in = R.quant_fp8_ref(randn(6, 256, seed=14), column_major_scales=True)
    a, s = R.permute_ref(q, s_in, r2t, off)
    assert a.dtype == FP8 and mn_major(s)
    codes_in, codes = codes_of(q), codes_of(a)
    for r in range(off[-1].item()):
        t = r2t[r].item()
        want = (codes_in[t], s_in[t].tolist()) if t >= 0 else ([0] * 256, [1.0, 1.0])
        assert (codes[r], s[r].tolist()) == want, r


def test_permute_empty():
    x = torch.zeros(0, 256, dtype=torch.bfloat16)
    off = torch.zeros(5, dtype=torch.int32)
    a, s = R.permute_quant_ref(x, torch.zeros(0, dtype=torch.int32), off)
    assert a.shape == (0, 256) and s.shape == (0, 2)
    a, s = R.permute_ref(a[:0], s[:0], torch.zeros(0, dtype=torch.int32), off)
    assert a.shape == (0, 256) and s.shape == (0, 2)


# ----------------------------------------------------------------------------- grouped GEMM


def naive_gemm_exact(a, a_scale, b, b_scale, offsets):
    """Row by row, block by block, in f64 (exact block sums; no f32 rounding at all)."""
    M, K = a.shape
    E, N, _ = b.shape
    out = torch.zeros(M, N, dtype=torch.float64)
    for e in range(E):
        bs = b_scale[e].double().repeat_interleave(128, 0)[:N]
        for r in range(offsets[e], offsets[e + 1]):
            for kb in range(K // 128):
                ks = slice(kb * 128, (kb + 1) * 128)
                part = b[e, :, ks].double() @ a[r, ks].double()
                out[r] += a_scale[r, kb].double() * bs[:, kb] * part
    return out


def test_grouped_gemm_vs_naive():
    # ragged segments incl. an empty expert and rows past off[-1]; N = 200 (not a multiple of 128).
    # tolerance: one bf16 rounding (2^-8 relative) over the exact f64 result; rows past off[-1] are 0.
    offsets = [0, 5, 5, 12, 19]
    M, K, N, E = 22, 256, 200, 4
    a, a_scale = R.quant_fp8_ref(randn(M, K, seed=20), column_major_scales=True)
    a_scale = a_scale * (1 + torch.rand(M, 1, generator=gen(21)))
    b, b_scale = R.quant_block_128x128_ref(randn(E, N, K, seed=22, scale=0.1))
    c = R.grouped_gemm_fp8_ref(a, a_scale, b, b_scale, torch.tensor(offsets, dtype=torch.int32))
    assert c.dtype == torch.bfloat16 and c.shape == (M, N)
    want = naive_gemm_exact(a.float(), a_scale, b.float(), b_scale, offsets)
    err = (c.double() - want).abs()
    assert torch.all(err <= want.abs() * 2.0**-8 + 1e-6), err.max()
    assert torch.all(c[19:] == 0)


def test_grouped_gemm_empty():
    b, b_scale = R.quant_block_128x128_ref(randn(2, 64, 128, seed=23))
    a = torch.zeros(0, 128).to(FP8)
    c = R.grouped_gemm_fp8_ref(a, torch.zeros(0, 1), b, b_scale, torch.zeros(3, dtype=torch.int32))
    assert c.shape == (0, 64) and c.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- silu_mul_quant


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_silu_mul_quant_vs_naive(gate_first, scale_fmt):
    # y = silu(gate) * up via the same f32 torch ops per row, then the naive quant: codes/scales exact.
    # Independently y matches x/(1+exp(-x))*up in f64 to 1e-6 relative.
    M, I = 10, 256
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    h = randn(M, 2 * I, seed=30, dtype=torch.bfloat16, scale=3.0)
    a2, s = R.silu_mul_quant_ref(h, off, gate_first, scale_fmt)
    assert a2.shape == (M, I) and a2.dtype == FP8 and s.shape == (M, 2) and mn_major(s)
    codes = codes_of(a2)
    for r in range(M):
        row = h[r].float()
        gate, up = (row[:I], row[I:]) if gate_first else (row[I:], row[:I])
        y = F.silu(gate) * up if r < 8 else torch.zeros(I)
        assert (codes[r], s[r].tolist()) == naive_quant_row(y.tolist(), 128, scale_fmt), r
        if r < 8:
            exact = [g / (1 + math.exp(-g)) * u for g, u in zip(gate.tolist(), up.tolist())]
            torch.testing.assert_close(y.double(), torch.tensor(exact, dtype=torch.float64), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_silu_mul_quant_counts(scale_fmt):
    # With align's expert_counts the padding rows (off[e] + counts[e] <= r < off[e+1]) are
    # unspecified; the reference computes every row as without counts (its output does not
    # depend on them), and the real rows are the naive SwiGLU + quant of their h rows.
    off, r2t, _, counts = routed_layout(T=7, k=3, E=5, alignment=4, seed=32)
    M, I = r2t.shape[0], 128
    h = randn(M, 2 * I, seed=33, dtype=torch.bfloat16, scale=3.0)
    a2, s = R.silu_mul_quant_ref(h, off, True, scale_fmt, counts)
    a2_plain, s_plain = R.silu_mul_quant_ref(h, off, True, scale_fmt)
    assert codes_of(a2) == codes_of(a2_plain) and torch.equal(s, s_plain) and mn_major(s)
    real = [r for e in range(5) for r in range(off[e].item(), off[e].item() + counts[e].item())]
    assert len(real) == 7 * 3 and all(r2t[r] >= 0 for r in real)
    codes = codes_of(a2)
    for r in real:
        row = h[r].float()
        y = F.silu(row[:I]) * row[I:]
        assert (codes[r], s[r].tolist()) == naive_quant_row(y.tolist(), 128, scale_fmt), r


# ----------------------------------------------------------------------------- finalize / moe_reduce


def test_finalize_vs_naive():
    # same f32 operations in the same order j = 0..k-1 -> bit-identical bf16 output
    T, k, M, H = 7, 3, 30, 64
    y = randn(M, H, seed=40, dtype=torch.bfloat16)
    w = torch.rand(T, k, generator=gen(41)) + 0.1
    t2r = torch.randint(0, M, (T, k), generator=gen(42), dtype=torch.int32)
    t2r[1, 0] = t2r[3, 2] = t2r[4, 1] = -1
    t2r[5] = -1
    w[5] = float("nan")  # -1 entries contribute nothing, not even a NaN weight
    out = R.finalize_ref(y, w, t2r)
    want = torch.zeros(T, H)
    for t in range(T):
        acc = torch.zeros(H)
        for j in range(k):
            if t2r[t, j] >= 0:
                acc = acc + w[t, j] * y[t2r[t, j]].float()
        want[t] = acc
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    assert torch.all(out[5] == 0)
    assert R.finalize_ref(y, w[:0], t2r[:0]).shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp32_acc", [False, True])
def test_moe_reduce_vs_naive(dtype, fp32_acc):
    # f32 accumulation: the naive f32 loop, cast once. 16-bit accumulation (lmdeploy's
    # fp32_acc=False): element by element, each product and sum rounded to the dtype.
    T, k, H = 5, 4, 96
    hidden = randn(T, k, H, seed=50, dtype=dtype)
    w = torch.rand(T, k, generator=gen(51))
    out = R.moe_reduce_ref(hidden, w, fp32_acc)
    if fp32_acc or dtype == torch.float32:
        want = torch.stack([sum((w[t, j] * hidden[t, j].float() for j in range(k)), torch.zeros(H)) for t in range(T)])
    else:
        rnd = lambda v: torch.tensor(v, dtype=torch.float32).to(dtype).item()  # noqa: E731
        want = torch.tensor([[0.0] * H] * T)
        for t in range(T):
            for h in range(H):
                acc = 0.0
                for j in range(k):
                    acc = rnd(acc + rnd(rnd(w[t, j].item()) * hidden[t, j, h].item()))
                want[t, h] = acc
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out, want.to(dtype), rtol=0, atol=0)
    assert R.moe_reduce_ref(hidden[:0], w[:0]).shape == (0, H)


# ----------------------------------------------------------------------------- fused MoE


def make_weights(E, H, I, seed):
    w13, w13s = R.quant_block_128x128_ref(randn(E, 2 * I, H, seed=seed, scale=0.05))
    w2, w2s = R.quant_block_128x128_ref(randn(E, H, I, seed=seed + 1, scale=0.05))
    return w13, w13s, w2, w2s


def naive_expert(xrow, e, w13, w13s, w2, w2s, gate_first, fmt):
    """One token through one local expert, each step as its own loop, intermediates rounded like the pipeline."""

    def gemm_row(codes_scales, w, ws):
        codes, scales = codes_scales
        a = torch.tensor(codes, dtype=torch.uint8).view(FP8).double()
        out = torch.zeros(w.shape[1], dtype=torch.float64)
        wsr = ws[e].double().repeat_interleave(128, 0)[: w.shape[1]]
        for kb, sc in enumerate(scales):
            ks = slice(kb * 128, (kb + 1) * 128)
            out += sc * wsr[:, kb] * (w[e, :, ks].double() @ a[ks])
        return out.to(torch.bfloat16)

    I = w2.shape[2]
    h = gemm_row(naive_quant_row(xrow.float().tolist(), 128, fmt), w13, w13s).float()
    gate, up = (h[:I], h[I:]) if gate_first else (h[I:], h[:I])
    return gemm_row(naive_quant_row((F.silu(gate) * up).tolist(), 128, fmt), w2, w2s).float()


@pytest.mark.parametrize("gate_first,fmt,expert_offset", [(True, None, 0), (False, "ue8m0", 2), (True, None, 5)])
def test_fused_moe_routed_vs_naive(gate_first, fmt, expert_offset):
    # EP: 3 local experts of 8; naive is a per-token loop over its local experts.
    # tolerance 1e-2 relative of max|out|: the naive GEMMs sum in another order, so a bf16 intermediate
    # can round differently and flip an fp8 code now and then.
    T, k, E, E_local, H, I = 6, 3, 8, 3, 256, 128
    x = randn(T, H, seed=60, dtype=torch.bfloat16)
    ids, w = R.route_ref(randn(T, E, seed=61), k, "renormalize")
    weights = make_weights(E_local, H, I, seed=62)
    out = R.fused_moe_routed_ref(x, ids, w, *weights, expert_offset, gate_first, fmt)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = ids[t, j].item() - expert_offset
            if 0 <= e < E_local:
                want[t] += w[t, j] * naive_expert(x[t], e, *weights, gate_first, fmt)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert want.abs().max() > 0
    torch.testing.assert_close(out.float(), want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_fused_moe_is_route_then_routed():
    T, E, H, I = 5, 8, 128, 128
    x = randn(T, H, seed=70, dtype=torch.bfloat16)
    logits = randn(T, E, seed=71)
    bias = randn(E, seed=72, scale=0.1)
    weights = make_weights(E, H, I, seed=73)
    out = R.fused_moe_ref(x, logits, *weights, 2, "deepseek_v3", bias, 4, 2, 2.5, num_experts=E)
    ids, w = R.route_ref(logits, 2, "deepseek_v3", bias, 4, 2, 2.5)
    assert torch.equal(out, R.fused_moe_routed_ref(x, ids, w, *weights))
    with pytest.raises(ValueError):
        R.fused_moe_ref(x, logits, *weights, 2, "softmax", num_experts=E + 1)
    empty = R.fused_moe_ref(x[:0], logits[:0], *weights, 2, "softmax")
    assert empty.shape == (0, H) and empty.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- fill_kv_cache_fp8


def naive_fill(states, cache, scale_cache, cu, kv_lens, block_offsets, g, fmt, layout):
    bs = cache.shape[1] if layout == "bshd" else cache.shape[2]
    codes = cache.view(torch.uint8)
    for b in range(len(kv_lens)):
        q_len = cu[b + 1] - cu[b]
        for j in range(q_len):
            pos = kv_lens[b] - q_len + j
            blk, slot = block_offsets[b][pos // bs], pos % bs
            for h in range(states.shape[1]):
                c, s = naive_quant_row(states[cu[b] + j, h].float().tolist(), g, fmt)
                idx = (blk, slot, h) if layout == "bshd" else (blk, h, slot)
                codes[idx] = torch.tensor(c, dtype=torch.uint8)
                scale_cache[idx] = torch.tensor(s)


def test_fill_kv_cache_skips_tokens_in_no_sequence():
    """Tokens before cu_seqlens_q[0] (and every token when B = 0) belong to no sequence: nothing
    is written for them; the others land as the naive loop puts them."""
    H, D, bs, nblk = 2, 128, 4, 8
    states = randn(7, H, D, seed=90, dtype=torch.bfloat16)
    table = torch.arange(nblk, dtype=torch.int32).reshape(2, 4)
    cu, kv_lens = [3, 5, 7], [6, 2]  # tokens 0..2 in no sequence
    got = (poisoned((nblk, bs, H, D), 91, True), poisoned((nblk, bs, H, 1), 91, False))
    want = tuple(t.clone() for t in got)
    R.fill_kv_cache_fp8_ref(states, None, got[0], None, got[1], None, torch.tensor(cu, dtype=torch.int32),
                            torch.tensor(kv_lens, dtype=torch.int32), table)  # fmt: skip
    naive_fill(states, want[0], want[1], cu, kv_lens, table.tolist(), 128, None, "bshd")
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    before = tuple(t.clone() for t in got)
    R.fill_kv_cache_fp8_ref(states, None, got[0], None, got[1], None, torch.tensor([0], dtype=torch.int32),
                            torch.zeros(0, dtype=torch.int32), table[:0])  # fmt: skip
    assert torch.equal(got[0].view(torch.uint8), before[0].view(torch.uint8))


def poisoned(shape, seed, fp8):
    if fp8:
        return torch.randint(0, 256, shape, generator=gen(seed), dtype=torch.uint8).view(FP8)
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(
    "with_v,D,Dv,g,fmt", [(True, 256, 128, 128, None), (True, 64, 64, 64, "ue8m0"), (False, 192, 0, 64, None)]
)
def test_fill_kv_cache_vs_naive(layout, with_v, D, Dv, g, fmt):
    # 3 sequences: prefill without history, decode (q_len 1), chunked prefill with 4 tokens of history.
    # Whole caches compared bit for bit, so untouched slots must keep their poison bytes (and NaN scales).
    H, bs, nblk = 2, 4, 12
    q_lens, kv_lens = [3, 1, 5], [3, 7, 9]
    cu = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]  # [0, 3, 4, 9]
    block_offsets = torch.randperm(nblk, generator=gen(80))[:9].reshape(3, 3).to(torch.int32)
    k_states = randn(9, H, D, seed=81, dtype=torch.bfloat16)
    v_states = randn(9, H, Dv, seed=82, dtype=torch.float16) if with_v else None

    def cache_shape(d):
        return (nblk, bs, H, d) if layout == "bshd" else (nblk, H, bs, d)

    def fresh(seed):
        kc, ks = poisoned(cache_shape(D), seed, True), poisoned(cache_shape(D // g), seed, False)
        vc = poisoned(cache_shape(Dv), seed + 1, True) if with_v else None
        vs = poisoned(cache_shape(Dv // g), seed + 1, False) if with_v else None
        return kc, vc, ks, vs

    got, want = fresh(83), fresh(83)
    ret = R.fill_kv_cache_fp8_ref(
        k_states, v_states, got[0], got[1], got[2], got[3],
        torch.tensor(cu, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32), block_offsets,
        group_size=g, scale_fmt=fmt, layout=layout,
    )  # fmt: skip
    assert ret is None
    bo = block_offsets.tolist()
    naive_fill(k_states, want[0], want[2], cu, kv_lens, bo, g, fmt, layout)
    if with_v:
        naive_fill(v_states, want[1], want[3], cu, kv_lens, bo, g, fmt, layout)
    for gc, wc in zip(got, want):
        if gc is None:
            continue
        if gc.dtype == FP8:
            assert torch.equal(gc.view(torch.uint8), wc.view(torch.uint8))
        else:
            torch.testing.assert_close(gc, wc, rtol=0, atol=0, equal_nan=True)
    # exactly 9 tokens x H heads were written, the rest of the scale cache is still NaN
    assert (~got[2].isnan()).sum().item() == 9 * H * (D // g)


def test_fill_kv_cache_no_tokens():
    kc = poisoned((4, 4, 1, 128), 90, True)
    before = kc.view(torch.uint8).clone()
    ks = poisoned((4, 4, 1, 1), 90, False)
    R.fill_kv_cache_fp8_ref(
        torch.zeros(0, 1, 128), None, kc, None, ks, None,
        torch.zeros(3, dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int32),
    )  # fmt: skip
    assert torch.equal(kc.view(torch.uint8), before) and ks.isnan().all()
