"""Every torch.ops.cute_moe op: torch.library.opcheck, equality with its reference, output layouts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import cute_moe
from cute_moe import ops as O
from cute_moe import reference as R

BF16, F16, F32, I32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn
H, I = 256, 128

# A case builds (op name, args, kwargs) from the per-test random factory `rnd`.
Case = Callable[[Any], tuple[str, tuple, dict]]


def _align(rnd, T: int, k: int, E: int, alignment: int = 8, *, E_global: int | None = None, expert_offset: int = 0):
    """Random top-k ids over E_global experts and the align outputs for the E local ones."""
    eg = E if E_global is None else E_global
    ids = rnd.topk_ids(T, k, eg)
    return ids, R.align_ref(ids, eg, alignment, expert_offset, E)


def _mn_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def _scales(rnd, rows: int, cols: int) -> torch.Tensor:
    return _mn_major(torch.rand(rows, cols, generator=rnd.gen) * 0.01 + 1e-3)


def _fp8(rnd, *shape: int) -> torch.Tensor:
    return rnd.randn(*shape, dtype=F32, scale=50.0).clamp(-448, 448).to(FP8)


def quant(T=5, K=H, dtype=BF16, **kw) -> Case:
    return lambda rnd: ("quant_fp8", (rnd.randn(T, K, dtype=dtype, scale=3.0),), kw)


def route(T, E, top_k, method, dtype=F32, bias=False, **kw) -> Case:
    def build(rnd):
        if bias:
            kw["score_bias"] = rnd.randn(E, dtype=F32, scale=0.1)
        return "route", (rnd.randn(T, E, dtype=dtype), top_k, method), kw

    return build


def align(T, k, E, **kw) -> Case:
    return lambda rnd: ("align", (rnd.topk_ids(T, k, E), E), kw)


def permute_quant(T, scale_fmt=None, with_t2r=None, ep=False, zero_padding=True) -> Case:
    """with_t2r: None, or the dtype token_to_row is passed in; ep: half the experts not local;
    zero_padding=False: padding rows unspecified (the CPU path still writes zeros)."""

    def build(rnd):
        kw = {"E_global": 8, "expert_offset": 2} if ep else {}
        _, (off, r2t, t2r, _) = _align(rnd, T, 2, 4, **kw)
        kwargs = {"scale_fmt": scale_fmt}
        if not zero_padding:
            kwargs["zero_padding"] = False
        if with_t2r is not None:
            kwargs["token_to_row"] = t2r.to(with_t2r)
        return "permute_quant", (rnd.randn(T, H, scale=2.0), r2t, off), kwargs

    return build


def permute(T) -> Case:
    def build(rnd):
        _, (off, r2t, _, _) = _align(rnd, T, 2, 4, expert_offset=2, E_global=8)
        q, s = R.quant_fp8_ref(rnd.randn(T, H, scale=2.0), 128, None, True)
        return "permute", (q, s, r2t, off), {}

    return build


def gemm(T, N=264, E=3, with_counts=False) -> Case:
    def build(rnd):
        _, (off, _, _, counts) = _align(rnd, T, 2, E, E_global=E + 1, expert_offset=1)  # global expert 0 is not local
        M = R.m_cap(T, 2, E, 8)
        b, bs = rnd.expert_weights(E, N, H)
        kwargs = {"expert_counts": counts} if with_counts else {}
        return "grouped_gemm_fp8", (_fp8(rnd, M, H), _scales(rnd, M, H // 128), b, bs, off), kwargs

    return build


def gemm_swiglu(T, E=3, with_counts=False, **kw) -> Case:
    def build(rnd):
        _, (off, _, _, counts) = _align(rnd, T, 2, E, E_global=E + 1, expert_offset=1)
        M = R.m_cap(T, 2, E, 8)
        w13, s13 = rnd.expert_weights(E, 256, H)
        kwargs = {**kw, "expert_counts": counts} if with_counts else kw
        return "grouped_gemm_fp8_swiglu", (_fp8(rnd, M, H), _scales(rnd, M, H // 128), w13, s13, off), kwargs

    return build


def silu(T, with_counts=False, **kw) -> Case:
    def build(rnd):
        _, (off, r2t, _, counts) = _align(rnd, T, 2, 4)
        kwargs = {**kw, "expert_counts": counts} if with_counts else kw
        return "silu_mul_quant", (rnd.randn(r2t.shape[0], 2 * I, scale=4.0), off), kwargs

    return build


def finalize(T, k=3) -> Case:
    def build(rnd):
        _, (_, r2t, t2r, _) = _align(rnd, T, k, 4, E_global=8, expert_offset=3)  # some entries not local
        return "finalize", (rnd.randn(r2t.shape[0], H), rnd.weights(T, k), t2r), {}

    return build


def moe_reduce(T, dtype=BF16, **kw) -> Case:
    return lambda rnd: ("moe_reduce", (rnd.randn(T, 3, H, dtype=dtype), rnd.weights(T, 3)), kw)


def _moe_weights(rnd, E_local: int) -> tuple:
    w13, s13 = rnd.expert_weights(E_local, 2 * I, H)
    w2, s2 = rnd.expert_weights(E_local, H, I)
    return w13, s13, w2, s2


def fused_routed(T, k=2, x_dtype=BF16, x_scale=1.0, **kw) -> Case:
    def build(rnd):
        ids = rnd.topk_ids(T, k, 8)
        args = (rnd.randn(T, H, dtype=x_dtype, scale=x_scale), ids, rnd.weights(T, k), *_moe_weights(rnd, 4))
        return "fused_moe_routed", args, {"expert_offset": 2, **kw}

    return build


def fused(T, E_global, E_local, top_k, method, bias=False, **kw) -> Case:
    def build(rnd):
        if bias:
            kw["score_bias"] = rnd.randn(E_global, dtype=F32, scale=0.1)
        args = (rnd.randn(T, H), rnd.randn(T, E_global, dtype=F32), *_moe_weights(rnd, E_local), top_k, method)
        return "fused_moe", args, kw

    return build


def kv(layout="bshd", with_v=True, D=128, Dv=128, group_size=64, dtype=BF16, **kw) -> Case:
    def build(rnd):
        q_lens, kv_lens, bs, nb, Hkv = [3, 1, 0], [5, 9, 2], 4, 10, 2
        N = sum(q_lens)

        def cache(d, g):
            shape = (nb, bs, Hkv, d) if layout == "bshd" else (nb, Hkv, bs, d)
            sshape = shape[:3] + (d // g,)
            return _fp8(rnd, *shape), torch.rand(*sshape, generator=rnd.gen) + 0.5

        kc, ksc = cache(D, group_size)
        vs, vc, vsc = (rnd.randn(N, Hkv, Dv, dtype=dtype), *cache(Dv, group_size)) if with_v else (None, None, None)
        cu = torch.tensor([0, 3, 4, 4], dtype=I32)
        block_offsets = torch.randperm(nb, generator=rnd.gen)[:9].reshape(3, 3).to(I32)
        args = (
            rnd.randn(N, Hkv, D, dtype=dtype),
            vs,
            kc,
            vc,
            ksc,
            vsc,
            cu,
            torch.tensor(kv_lens, dtype=I32),
            block_offsets,
        )
        return "fill_kv_cache_fp8", args, {"group_size": group_size, "layout": layout, **kw}

    return build


CASES: dict[str, Case] = {
    "quant_fp8-bf16": quant(),
    "quant_fp8-f32-g64-ue8m0-colmajor": quant(7, 192, F32, group_size=64, scale_fmt="ue8m0", column_major_scales=True),
    "quant_fp8-fp16-T0-colmajor": quant(0, H, F16, column_major_scales=True),
    "route-softmax": route(6, 16, 4, "softmax"),
    "route-renormalize-bf16": route(6, 16, 2, "renormalize", BF16),
    "route-llama4-fp16": route(6, 16, 2, "llama4", F16),
    "route-deepseek_v3": route(6, 32, 4, "deepseek_v3", bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "route-llama4": route(6, 16, 1, "llama4"),
    "route-sigmoid_renorm-T0": route(0, 8, 2, "sigmoid_renorm"),
    "align": align(9, 2, 8, alignment=4),
    "align-ep": align(5, 4, 16, expert_offset=4, num_local_experts=8),
    "align-T0": align(0, 2, 8),
    "permute_quant": permute_quant(6),
    "permute_quant-ue8m0": permute_quant(3, "ue8m0"),
    "permute_quant-T0": permute_quant(0),
    "permute_quant-t2r": permute_quant(6, with_t2r=I32),
    "permute_quant-t2r-i64-ep-ue8m0": permute_quant(5, "ue8m0", with_t2r=torch.int64, ep=True),
    "permute_quant-t2r-T0": permute_quant(0, with_t2r=I32),
    "permute_quant-t2r-nozero": permute_quant(6, with_t2r=I32, zero_padding=False),
    "permute": permute(6),
    "permute-T0": permute(0),
    "grouped_gemm_fp8": gemm(7),
    "grouped_gemm_fp8-N128-E1": gemm(4, N=128, E=1),
    "grouped_gemm_fp8-T0": gemm(0),
    "grouped_gemm_fp8-counts": gemm(7, with_counts=True),
    "grouped_gemm_fp8_swiglu": gemm_swiglu(7),
    "grouped_gemm_fp8_swiglu-counts-upfirst-ue8m0": gemm_swiglu(6, with_counts=True, gate_first=False, scale_fmt="ue8m0"),
    "grouped_gemm_fp8_swiglu-T0": gemm_swiglu(0),
    "silu_mul_quant": silu(5),
    "silu_mul_quant-upfirst-ue8m0": silu(3, gate_first=False, scale_fmt="ue8m0"),
    "silu_mul_quant-T0": silu(0),
    "silu_mul_quant-counts": silu(5, with_counts=True),
    "silu_mul_quant-counts-upfirst-ue8m0": silu(4, with_counts=True, gate_first=False, scale_fmt="ue8m0"),
    "silu_mul_quant-counts-T0": silu(0, with_counts=True),
    "finalize": finalize(6),
    "finalize-T0": finalize(0),
    "moe_reduce-bf16": moe_reduce(5),
    "moe_reduce-fp16-fp32acc": moe_reduce(4, F16, fp32_acc=True),
    "moe_reduce-f32-T0": moe_reduce(0, F32),
    "fused_moe_routed": fused_routed(5),
    "fused_moe_routed-upfirst-ue8m0": fused_routed(3, gate_first=False, act_scale_fmt="ue8m0"),
    "fused_moe_routed-weight-on-input": fused_routed(5, k=1, apply_router_weight_on_input=True),
    "fused_moe_routed-weight-on-input-k2-ep": fused_routed(5, apply_router_weight_on_input=True),
    "fused_moe_routed-fp16": fused_routed(4, x_dtype=F16),
    # small fp16 outputs (fp16 subnormals): the k slots' bf16 rows summed in f32, never rounded to fp16 first
    "fused_moe_routed-fp16-weight-on-input-k2": fused_routed(64, x_dtype=F16, x_scale=0.02,
                                                             apply_router_weight_on_input=True),
    "fused_moe-deepseek_v3-ep": fused(
        5,
        8,
        4,
        2,
        "deepseek_v3",
        bias=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        expert_offset=4,
        num_experts=8,
    ),
    "fused_moe-renormalize": fused(4, 4, 4, 2, "renormalize"),
    "fused_moe-softmax-T0": fused(0, 4, 4, 2, "softmax"),
    "fused_moe-llama4": fused(5, 8, 4, 1, "llama4"),
    "fused_moe-llama4-weight-on-output": fused(5, 8, 8, 1, "llama4", apply_router_weight_on_input=False),
    "fill_kv_cache_fp8-bshd": kv(),
    "fill_kv_cache_fp8-bhsd-ue8m0-f32": kv("bhsd", dtype=F32, scale_fmt="ue8m0"),
    "fill_kv_cache_fp8-mla-k-only": kv(with_v=False, D=192, group_size=64),
}

# every op of the spec is covered
assert {c.split("-")[0] for c in CASES} == set(O.__all__)


def _build(name: str, rnd) -> tuple[Any, tuple, dict]:
    op_name, args, kwargs = CASES[name](rnd)
    return op_name, args, kwargs


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _assert_equal(out: Any, ref: Any) -> None:
    if isinstance(out, (tuple, list)):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            _assert_equal(o, r)
        return
    if out is None:
        assert ref is None
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == FP8:
        out, ref = out.view(torch.uint8), ref.view(torch.uint8)
    assert torch.equal(out, ref)


_FP8_DTYPES = {d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d)}


@pytest.fixture
def fp8_allclose(monkeypatch: pytest.MonkeyPatch) -> None:
    """opcheck's test_schema (SchemaCheckMode) compares every input before/after with torch.allclose,
    which has no float8 kernel ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). Compare
    float8 tensors bit for bit instead; everything else goes to the real allclose."""
    real = torch.allclose

    def allclose(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
        if a.dtype in _FP8_DTYPES and b.dtype == a.dtype:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name: str, rnd, fp8_allclose: None) -> None:
    op_name, args, kwargs = _build(name, rnd)
    torch.library.opcheck(getattr(torch.ops.cute_moe, op_name).default, args, kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str, rnd) -> None:
    op_name, args, kwargs = _build(name, rnd)
    ref_args = _clone(args)
    out = getattr(cute_moe, op_name)(*args, **kwargs)  # the functional API -> torch.ops.cute_moe
    # zero_padding=False leaves padding rows unspecified; on the CPU they are the reference's zeros.
    ref = getattr(R, f"{op_name}_ref")(*ref_args, **{k: v for k, v in kwargs.items() if k != "zero_padding"})
    _assert_equal(out, ref)
    if op_name == "fill_kv_cache_fp8":  # the mutated caches are the output
        assert out is None
        _assert_equal(
            [a for a in args if isinstance(a, torch.Tensor)], [a for a in ref_args if isinstance(a, torch.Tensor)]
        )


@pytest.mark.parametrize(
    "name", [n for n in CASES if n.split("-")[0] in ("permute_quant", "permute", "silu_mul_quant",
                                                     "grouped_gemm_fp8_swiglu")]  # fmt: skip
)
def test_gemm_feeding_scales_are_mn_major(name: str, rnd) -> None:
    op_name, args, kwargs = _build(name, rnd)
    a, s = getattr(cute_moe, op_name)(*args, **kwargs)
    rows = a.shape[0]
    assert s.shape == (rows, a.shape[1] // 128) and s.dtype == F32
    assert s.stride() == torch.empty(s.shape[1], rows).t().stride()  # (1, rows)
    assert a.is_contiguous()


@pytest.mark.parametrize("column_major", [False, True])
def test_quant_fp8_scale_layout(column_major: bool, rnd) -> None:
    q, s = cute_moe.quant_fp8(rnd.randn(6, H), column_major_scales=column_major)
    assert q.is_contiguous() and q.dtype == FP8
    assert s.stride() == ((1, 6) if column_major else (2, 1))


@pytest.mark.parametrize(("T", "k", "method"), [(0, 4, "softmax"), (1, 4, "softmax"), (0, 1, "llama4"), (3, 2, "renormalize")])
def test_route_outputs_have_the_fakes_strides(T: int, k: int, method: str) -> None:
    """(k, 1) as the fake and the kernel give them, also where T <= 1 lets a view pass for contiguous."""
    logits = torch.randn(T, 16)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.cute_moe.route(mode.from_tensor(logits), k, method)
    for got, want in zip(torch.ops.cute_moe.route(logits, k, method), fake):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_align_m_cap_is_static(rnd) -> None:
    for T, k, E, a in [(1, 8, 256, 128), (7, 2, 4, 16), (0, 2, 4, 128)]:
        off, r2t, t2r, counts = cute_moe.align(rnd.topk_ids(T, k, E), E, alignment=a)
        assert r2t.shape == (R.m_cap(T, k, E, a),) and off.shape == (E + 1,) and counts.shape == (E,)
        assert t2r.shape == (T, k)
    assert R.m_cap(1, 8, 256, 128) == 1024


def test_fused_moe_equals_composed_ops(rnd) -> None:
    """fused_moe == route -> fused_moe_routed, with EP ids outside the local range dropped."""
    _, args, kwargs = _build("fused_moe-deepseek_v3-ep", rnd)
    x, logits, w13, s13, w2, s2, top_k, method = args
    ids, w = cute_moe.route(
        logits, top_k, method, score_bias=kwargs["score_bias"], n_group=2, topk_group=1, routed_scaling_factor=2.5
    )
    out = cute_moe.fused_moe_routed(x, ids, w, w13, s13, w2, s2, expert_offset=4)
    _assert_equal(cute_moe.fused_moe(*args, **kwargs), out)


def test_fused_moe_gives_the_gemms_expected_m(rnd, monkeypatch) -> None:
    """fused_moe passes both GEMMs ``T * top_k // num_experts`` rows per expert (global experts: on
    an expert-parallel slice M_cap counts every routed row); so does fused_moe_routed given
    ``num_experts``, as FusedMoE.forward_routed gives it, and None without (the GEMMs estimate from
    M_cap)."""
    seen = []
    real_call = O.call

    def spy(name, *args):
        if name.startswith("grouped_gemm_fp8"):
            seen.append((name, args[-1]))
        return real_call(name, *args)

    monkeypatch.setattr(O, "call", spy)
    _, args, kwargs = _build("fused_moe-deepseek_v3-ep", rnd)  # T = 5, top_k = 2, 8 experts, 4 local
    cute_moe.fused_moe(*args, **kwargs)
    assert seen == [("grouped_gemm_fp8_swiglu", 1), ("grouped_gemm_fp8", 1)]
    seen.clear()
    _, args, kwargs = _build("fused_moe_routed", rnd)  # T = 5, top_k = 2, 4 local experts
    cute_moe.fused_moe_routed(*args, **kwargs)
    assert seen == [("grouped_gemm_fp8_swiglu", None), ("grouped_gemm_fp8", None)]
    seen.clear()
    cute_moe.fused_moe_routed(*args, **kwargs, num_experts=6)
    assert seen == [("grouped_gemm_fp8_swiglu", 1), ("grouped_gemm_fp8", 1)]
    seen.clear()
    layer = cute_moe.FusedMoE.from_fp8(*args[3:], top_k=2, num_experts=4, routing_method="softmax")
    layer.forward_routed(args[0], args[1] % 4, args[2])
    assert seen == [("grouped_gemm_fp8_swiglu", 2), ("grouped_gemm_fp8", 2)]


def test_fused_moe_routed_negative_ids_contribute_nothing(rnd) -> None:
    """Ids outside the local range, -1 included (what vLLM's expert map gives a non-local expert),
    contribute nothing: the same output as those slots given weight 0.  The GPU kernels treat them
    so; the CPU path refused negative ids with align's message before."""
    _, args, _ = _build("fused_moe-deepseek_v3-ep", rnd)
    x, logits, w13, s13, w2, s2, top_k, _ = args
    T = x.shape[0]
    ids = rnd.topk_ids(T, top_k, w13.shape[0])
    weights = torch.rand(T, top_k)
    dropped = torch.rand(T, top_k) < 0.3
    for outside in (-1, -(2**31), 2**31 - 1, w13.shape[0]):
        got = cute_moe.fused_moe_routed(x, torch.where(dropped, outside, ids), weights, w13, s13, w2, s2)
        want = cute_moe.fused_moe_routed(x, ids, torch.where(dropped, 0.0, weights), w13, s13, w2, s2)
        _assert_equal(got, want)


def test_router_weight_on_input(rnd) -> None:
    """apply_router_weight_on_input (HF Llama-4's convention): the expert sees x * bf16(w) and its
    output is not weighted; llama4 routing takes it by default. The two conventions differ (SwiGLU is
    not linear), so a layer that weighted the outputs would fail this."""
    _, args, _ = _build("fused_moe-llama4", rnd)
    x, logits, w13, s13, w2, s2, top_k, method = args
    ids, w = cute_moe.route(logits, top_k, method)
    on_input = cute_moe.fused_moe_routed(x, ids, w, w13, s13, w2, s2, apply_router_weight_on_input=True)
    scaled_x = x * w.bfloat16()
    _assert_equal(on_input, cute_moe.fused_moe_routed(scaled_x, ids, torch.ones_like(w), w13, s13, w2, s2))
    _assert_equal(cute_moe.fused_moe(*args), on_input)
    on_output = cute_moe.fused_moe(*args, apply_router_weight_on_input=False)
    _assert_equal(on_output, cute_moe.fused_moe_routed(x, ids, w, w13, s13, w2, s2))
    touched = on_input.float().norm(dim=1) > 0
    assert touched.sum() >= 2
    rel = ((on_input.float() - on_output.float()).norm() / on_output.float().norm()).item()
    assert rel > 0.1, rel  # of order one here, where the FP8 tolerance is ~5%


def test_router_weight_on_input_top_k_2(rnd) -> None:
    """With k > 1 the input-side convention sums the k experts' outputs on their own scaled inputs:
    out = bf16(sum_j expert_j(x * w_j)), each term a top-1 layer's exact bf16 row, summed in f32."""
    _, args, kwargs = _build("fused_moe-renormalize", rnd)
    x, logits, w13, s13, w2, s2, top_k, _ = args
    assert top_k == 2
    ids, w = cute_moe.route(logits, top_k, "llama4")
    ones = torch.ones(x.shape[0], 1)
    terms = [cute_moe.fused_moe_routed(x * w[:, j : j + 1].bfloat16(), ids[:, j : j + 1].contiguous(), ones,
                                       w13, s13, w2, s2).float() for j in range(top_k)]  # fmt: skip
    want = (terms[0] + terms[1]).bfloat16()
    _assert_equal(cute_moe.fused_moe_routed(x, ids, w, w13, s13, w2, s2, apply_router_weight_on_input=True), want)
    _assert_equal(cute_moe.fused_moe(x, logits, w13, s13, w2, s2, top_k, "llama4"), want)  # llama4's default
    # the outputs weighted instead
    out = cute_moe.fused_moe(x, logits, w13, s13, w2, s2, top_k, "llama4", apply_router_weight_on_input=False)
    _assert_equal(out, cute_moe.fused_moe_routed(x, ids, w, w13, s13, w2, s2))


def test_fused_moe_routed_takes_16_bit_weights(rnd) -> None:
    """An HF router's weights in a bf16 model are bf16: taken, as their exact f32 values."""
    _, args, kwargs = _build("fused_moe_routed", rnd)
    x, ids, w, *weights = args
    w16 = w.bfloat16()
    want = cute_moe.fused_moe_routed(x, ids, w16.float(), *weights, **kwargs)
    _assert_equal(cute_moe.fused_moe_routed(x, ids, w16, *weights, **kwargs), want)
    _assert_equal(cute_moe.fused_moe_routed(x, ids, w16.half(), *weights, **kwargs), want)


def test_ops_are_inference_only(rnd) -> None:
    """Inputs that require grad give outputs that do not (no autograd graph, no gradient through the
    op): torch's fallback used to warn, then propagate wrong gradients or fail on FP8 tensors."""
    _, args, kwargs = _build("fused_moe-deepseek_v3-ep", rnd)
    x = args[0].clone().requires_grad_()
    out = cute_moe.fused_moe(x, *args[1:], **kwargs)
    assert not out.requires_grad and out.grad_fn is None
    _assert_equal(out, cute_moe.fused_moe(*args, **kwargs))
    h, w = torch.randn(3, 2, 256, requires_grad=True), torch.rand(3, 2, requires_grad=True)
    for out in (cute_moe.moe_reduce(h, w), *cute_moe.quant_fp8(h.reshape(6, 256)),
                *cute_moe.route(torch.randn(3, 8, requires_grad=True), 2, "softmax")):  # fmt: skip
        assert not out.requires_grad
    # MN-major scales made under no_grad are not views: changing them in place with grad mode on
    # (an operand that requires grad) is allowed, as for any fresh tensor.
    _, s = cute_moe.quant_fp8(h.reshape(6, 256), column_major_scales=True)
    assert s.stride() == (1, 6) and s._base is None
    s.add_(torch.zeros_like(s).requires_grad_())


def test_fused_moe_refuses_zero_local_experts(rnd) -> None:
    _, args, kwargs = _build("fused_moe-deepseek_v3-ep", rnd)
    x, logits, w13, s13, w2, s2, top_k, method = args
    none = (w13[:0], s13[:0], w2[:0], s2[:0])
    with pytest.raises(ValueError, match=r"cute_moe\.fused_moe: E_local \(w13\.shape\[0\]\) must be >= 1, got 0"):
        cute_moe.fused_moe(x, logits, *none, top_k, method, **kwargs)
    ids, wts = cute_moe.route(logits, top_k, "softmax")
    with pytest.raises(ValueError, match=r"cute_moe\.fused_moe_routed: E_local \(w13\.shape\[0\]\) must be >= 1"):
        cute_moe.fused_moe_routed(x, ids, wts, *none)


def test_cpu_index_data_out_of_range_is_named(rnd) -> None:
    """The CPU implementations read the index tensors: entries out of range get a ValueError naming
    them (they gave IndexError / shape errors from inside the reference, or -2 was taken as -1)."""
    x = torch.randn(3, 256).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    off, r2t, t2r, counts = cute_moe.align(ids, 4, alignment=8)
    a, a_s = cute_moe.permute_quant(x, r2t, off)
    w, w_s = rnd.expert_weights(4, 256, 256)
    y = cute_moe.grouped_gemm_fp8(a, a_s, w, w_s, off)
    m_cap = r2t.shape[0]
    past_end = torch.where(t2r == t2r.max(), m_cap, t2r)
    h = torch.randn(m_cap, 256).bfloat16()
    row = "\\[-1, 3\\)"
    cases = [
        (lambda: cute_moe.permute_quant(x, torch.where(r2t == 2, 3, r2t), off),
         f"permute_quant: row_to_token entries must lie in {row}, got 3"),
        (lambda: cute_moe.permute_quant(x, torch.where(r2t == -1, -2, r2t), off),
         f"row_to_token entries must lie in {row}, got -2"),
        (lambda: cute_moe.permute_quant(x, r2t, off, token_to_row=past_end),
         f"permute_quant: token_to_row entries must lie in \\[-1, {m_cap}\\)"),
        (lambda: cute_moe.permute(a[:3], a_s[:3], torch.where(r2t == 2, 7, r2t), off),
         "permute: row_to_token entries"),
        (lambda: cute_moe.grouped_gemm_fp8(a, a_s, w, w_s, off + (m_cap + 1 - int(off[-1]))),
         f"grouped_gemm_fp8: expert_offsets entries must lie in \\[0, {m_cap + 1}\\), got {m_cap + 1}"),
        (lambda: cute_moe.grouped_gemm_fp8(a, a_s, w, w_s, off.flip(0)),
         "grouped_gemm_fp8: expert_offsets must be non-decreasing"),
        (lambda: cute_moe.grouped_gemm_fp8(a, a_s, w, w_s, off, expert_counts=counts + 8),
         "expert_counts\\[e\\] must lie in"),
        (lambda: cute_moe.silu_mul_quant(h, off.flip(0)), "silu_mul_quant: expert_offsets must be non-decreasing"),
        (lambda: cute_moe.silu_mul_quant(h, off, expert_counts=counts - 1),
         "silu_mul_quant: expert_counts\\[e\\] must lie in"),
        (lambda: cute_moe.finalize(y, torch.rand(3, 2), past_end),
         f"finalize: token_to_row entries must lie in \\[-1, {m_cap}\\), got {m_cap}"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_sm100_gemm_warns_once_that_it_never_ran(monkeypatch) -> None:
    import warnings  # noqa: PLC0415

    from cute_moe.kernels import grouped_gemm as gemm  # noqa: PLC0415

    monkeypatch.setattr(gemm, "_sm100_warned", False)
    gemm._arch_launcher.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an error the first time, and still usable after it
            with pytest.raises(UserWarning, match="sm_100a kernel is compiled and SASS-checked only and has never run"):
                gemm._arch_launcher("sm_100a")
            assert callable(gemm._arch_launcher("sm_100a"))
    finally:
        gemm._arch_launcher.cache_clear()


def test_cuda_impl_validates_before_importing_kernel() -> None:
    with pytest.raises(ValueError, match="group_size"):
        O.quant_fp8.kernels["cuda"](torch.randn(4, 100), 128)


def test_import_is_light() -> None:
    code = (
        "import sys, torch, cute_moe\n"
        "assert 'cutlass' not in sys.modules, 'cutlass imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "assert cute_moe.__version__ == '0.1.0'\n"
        "assert hasattr(torch.ops.cute_moe, 'fused_moe')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("arch,tile,path", [("sm_90a", 256, "fused"), ("sm_90a", 128, "fused"), ("sm_90a", None, "two"),
                                            ("sm_100a", 256, "two")])  # fmt: skip
def test_swiglu_cuda_entry_runs_one_path(monkeypatch, arch, tile, path) -> None:
    """The fused sm90 kernel of the width ``sm90_swiglu_tile`` gives, else (None) the GEMM (its errors
    naming grouped_gemm_fp8_swiglu) then silu_mul_quant; ``expected_m`` reaches the rule and the
    launcher that runs; the launchers stubbed, so this runs on the CPU."""
    pytest.importorskip("cutlass")
    from cute_moe.kernels import grouped_gemm, grouped_gemm_sm90, grouped_gemm_swiglu, silu_mul_quant  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(grouped_gemm_swiglu, "arch_of_device_index", lambda _: arch)
    monkeypatch.setattr(grouped_gemm_swiglu, "sm90_swiglu_tile", lambda *a: calls.append(("rule", a[-1])) or tile)
    monkeypatch.setattr(grouped_gemm_sm90, "grouped_gemm_fp8_swiglu_cuda",
                        lambda *a: calls.append(("fused", a[-2], a[-1])) or "q")  # fmt: skip
    monkeypatch.setattr(grouped_gemm, "grouped_gemm_fp8_cuda", lambda *a, op: calls.append(("gemm", op, a[-1])) or "h")
    monkeypatch.setattr(silu_mul_quant, "silu_mul_quant_cuda", lambda h, *a: calls.append(("silu", h)) or "q2")
    a = torch.empty(128, 256, dtype=torch.float8_e4m3fn)
    out = grouped_gemm_swiglu.grouped_gemm_fp8_swiglu_cuda(a, None, torch.empty(4, 256, 256), None, None,
                                                           expected_m=77)  # fmt: skip
    rule = [("rule", 77)] if arch == "sm_90a" else []
    if path == "fused":
        assert calls == rule + [("fused", 77, tile)] and out == "q"
    else:
        assert calls == rule + [("gemm", "grouped_gemm_fp8_swiglu", 77), ("silu", "h")] and out == "q2"


def test_gemm_launchers_take_the_op_name(monkeypatch) -> None:
    """Both architectures' launch functions accept the ``expected_m`` and ``op`` that
    grouped_gemm_fp8_cuda passes on."""
    import inspect  # noqa: PLC0415

    pytest.importorskip("cutlass")
    from cute_moe.kernels import grouped_gemm as gemm  # noqa: PLC0415

    monkeypatch.setattr(gemm, "_sm100_warned", False)
    gemm._arch_launcher.cache_clear()
    try:
        with pytest.warns(UserWarning):
            sm100 = gemm._arch_launcher("sm_100a")
        for fn in (gemm._arch_launcher("sm_90a"), sm100):
            inspect.signature(fn).bind(*range(6), expected_m=None, op="grouped_gemm_fp8_swiglu")
    finally:
        gemm._arch_launcher.cache_clear()


def test_debug_gemm_segment_check_names_the_op() -> None:
    """CUTE_MOE_DEBUG's segment checks, shared by both GEMM ops' CUDA paths: order, then alignment."""
    from cute_moe.ops import _check_gemm_segments  # noqa: PLC0415

    _check_gemm_segments("grouped_gemm_fp8_swiglu", torch.tensor([0, 128, 384], dtype=torch.int32), 384, None)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8_swiglu: expert_offsets must be multiples of 128"):
        _check_gemm_segments("grouped_gemm_fp8_swiglu", torch.tensor([0, 64, 384], dtype=torch.int32), 384, None)
    with pytest.raises(ValueError, match=r"grouped_gemm_fp8_swiglu: expert_offsets must be non-decreasing"):
        _check_gemm_segments("grouped_gemm_fp8_swiglu", torch.tensor([0, 256, 128], dtype=torch.int32), 384, None)
