"""torch.compile(fullgraph=True, dynamic=True) over models built on the cute_moe ops: one compile, no recompiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cute_moe
from cute_moe import reference as R

# inductor itself still calls torch.jit.script_method on CPU
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

E, H, I, TOP_K = 8, 256, 128, 2
TOKENS = (3, 5, 17)


class MoE(nn.Module):
    """One FP8 MoE layer spelled out op by op (the pipeline of ARCHITECTURE.md)."""

    def __init__(self, gen: torch.Generator, alignment: int = 128) -> None:
        super().__init__()
        self.alignment = alignment
        self.router = nn.Parameter(torch.randn(E, H, generator=gen) * 0.1, requires_grad=False)
        w13, s13 = R.quant_block_128x128_ref(torch.randn(E, 2 * I, H, generator=gen) * 0.05)
        w2, s2 = R.quant_block_128x128_ref(torch.randn(E, H, I, generator=gen) * 0.05)
        for name, t in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
            self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.router.t()
        ids, w = cute_moe.route(logits, TOP_K, "renormalize")
        offsets, row_to_token, token_to_row, _ = cute_moe.align(ids, E, alignment=self.alignment)
        a, a_scale = cute_moe.permute_quant(x, row_to_token, offsets)
        h = cute_moe.grouped_gemm_fp8(a, a_scale, self.w13, self.w13_scale, offsets)
        a2, a2_scale = cute_moe.silu_mul_quant(h, offsets)
        y = cute_moe.grouped_gemm_fp8(a2, a2_scale, self.w2, self.w2_scale, offsets)
        return cute_moe.finalize(y, w, token_to_row)


def _assert_one_graph(counter) -> None:
    # dynamo may also hand the backend an empty graph (a wrapper frame); only one graph holds the ops
    graphs = [g for g in counter.graphs if "cute_moe" in g.code]
    assert len(graphs) == 1, [g.code for g in counter.graphs]


def _inputs(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(T, H, generator=gen).bfloat16() for T in TOKENS]


def test_moe_module_compiles_once_for_all_token_counts(compile_counter) -> None:
    gen = torch.Generator().manual_seed(0)
    model = MoE(gen)
    compiled = torch.compile(model, backend=compile_counter, fullgraph=True, dynamic=True)
    frames = None
    for x in _inputs(gen):
        out = compiled(x)
        frames = frames or compile_counter.frame_count
        assert compile_counter.frame_count == frames  # no recompile for a new T
        ref = model(x)
        assert out.shape == (x.shape[0], H) and out.dtype == torch.bfloat16
        assert torch.equal(out, ref)
    _assert_one_graph(compile_counter)


def test_fused_moe_and_kv_cache_compile(compile_counter) -> None:
    """fused_moe (composite op) and fill_kv_cache_fp8 (mutates its caches) under one compiled graph."""
    gen = torch.Generator().manual_seed(1)
    m = MoE(gen)
    nb, bs, hkv, d = 16, 4, 2, 128

    def step(x, logits, kc, ksc, cu, kvl, bo):
        out = cute_moe.fused_moe(
            x,
            logits,
            m.w13,
            m.w13_scale,
            m.w2,
            m.w2_scale,
            TOP_K,
            "deepseek_v3",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        )
        kv = out.reshape(out.shape[0], hkv, d)
        cute_moe.fill_kv_cache_fp8(kv, None, kc, None, ksc, None, cu, kvl, bo, scale_fmt="ue8m0")
        return out

    compiled = torch.compile(step, backend=compile_counter, fullgraph=True, dynamic=True)
    for x in _inputs(gen):
        T = x.shape[0]
        logits = torch.randn(T, E, generator=gen)
        cu = torch.tensor([0, T], dtype=torch.int32)
        kvl = torch.tensor([T + 2], dtype=torch.int32)
        bo = torch.randperm(nb, generator=gen)[:6].reshape(1, 6).to(torch.int32)
        kc = torch.randn(nb, bs, hkv, d, generator=gen).to(torch.float8_e4m3fn)
        ksc = torch.rand(nb, bs, hkv, 1, generator=gen)
        kc_ref, ksc_ref = kc.clone(), ksc.clone()
        out = compiled(x, logits, kc, ksc, cu, kvl, bo)
        ref = step(x, logits, kc_ref, ksc_ref, cu, kvl, bo)
        assert torch.equal(out, ref)
        assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8)) and torch.equal(ksc, ksc_ref)
    _assert_one_graph(compile_counter)


def test_symbolic_scalars_reach_the_op_outside_dynamo() -> None:
    """make_fx's symbolic tracing hands the functional API SymInts / SymFloats; its type checks let
    them through to the op (they are not Python ints or floats, and not wrong either)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(logits):
        return cute_moe.route(logits, 2, "softmax", routed_scaling_factor=logits.shape[0] * 0.5)

    logits = torch.randn(4, 16)
    traced = make_fx(fn, tracing_mode="symbolic")(logits)
    for got, want in zip(traced(logits), fn(logits)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["route_top_k_bool", "quant_fp8_column_major_none", "fused_moe_gate_first_none"])
def test_compiled_calls_check_scalar_types(case) -> None:
    """Under torch.compile the functional API's scalar type checks still run: the dispatcher would
    take True for an int (top_k = 1) and None for a bool (False) without a word, and the compiled
    graph would run with the converted value (gate_first=None: gate and up swapped)."""
    torch._dynamo.reset()
    x, logits = torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, E)
    w13, s13 = R.quant_block_128x128_ref(torch.randn(E, 2 * I, H) * 0.05)
    w2, s2 = R.quant_block_128x128_ref(torch.randn(E, H, I) * 0.05)
    call, message = {
        "route_top_k_bool": (lambda: cute_moe.route(logits, True, "softmax"), "top_k must be an int"),
        "quant_fp8_column_major_none": (lambda: cute_moe.quant_fp8(x, column_major_scales=None),
                                        "column_major_scales must be a bool"),
        "fused_moe_gate_first_none": (lambda: cute_moe.fused_moe(x, logits, w13, s13, w2, s2, TOP_K, "renormalize",
                                                                 gate_first=None), "gate_first must be a bool"),
    }[case]  # fmt: skip
    with pytest.raises(Exception, match=message):
        torch.compile(call, fullgraph=True, dynamic=True)()


def test_meta_calls_check_the_scalars_the_shapes_depend_on() -> None:
    """The fakes (meta tensors, torch.compile's tracing) check the scalars their output shapes are
    computed from, by name, rather than dividing by zero or returning a shape for a bad value."""
    x, ids = torch.empty(4, 256, device="meta"), torch.empty(3, 2, dtype=torch.int32, device="meta")
    logits = torch.empty(3, 8, device="meta")
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        torch.ops.cute_moe.quant_fp8(x, 0, None, False)
    with pytest.raises(ValueError, match="K \\(x.shape\\[1\\]\\) must be divisible by group_size = 3"):
        torch.ops.cute_moe.quant_fp8(x, 3, None, False)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        torch.ops.cute_moe.route(logits, 99, "softmax", None, 1, 1, 1.0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        torch.ops.cute_moe.route(logits, -1, "softmax", None, 1, 1, 1.0)
    with pytest.raises(ValueError, match="alignment must be >= 1, got 0"):
        torch.ops.cute_moe.align(ids, 8, 0, 0, None)
    with pytest.raises(ValueError, match="num_local_experts must be >= 1, got -1"):
        torch.ops.cute_moe.align(ids, 8, 128, 0, -1)
