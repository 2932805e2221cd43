"""fused_moe end to end on the GPU: every step on its CuTe DSL kernel (route, align with
alignment 128, permute_quant, grouped_gemm_fp8, silu_mul_quant, grouped_gemm_fp8, finalize),
against an f32 reference of the same layer.

Models, all at full size (routed experts only):

* DeepSeek-V3     E=256, H=7168, I=2048,  top-8, ``deepseek_v3`` routing (groups 8/4, score_bias, x2.5), f32 logits
* Qwen3-30B-A3B   E=128, H=2048, I=768,   top-8, ``renormalize`` (norm_topk_prob), bf16 logits
* Mixtral-8x7B    E=8,   H=4096, I=14336, top-2, ``renormalize`` (softmax over the top-k logits = HF Mixtral's
                  softmax, top-k, divide by the sum), bf16 logits
* Llama-4-Scout   E=16,  H=5120, I=8192,  top-1, ``llama4`` (sigmoid of the top logit, applied to the
                  expert's input, HF Llama-4's convention and fused_moe's default for it), bf16 logits

for T in {0, 1, 5, 256, 4096} tokens (no case skipped: the reference of the largest, DeepSeek-V3
at T=4096, is ~3e12 f32 FLOPs, well under a second on an H200).

Weights (``cute_moe.testing.random_fp8_experts``) are random FP8 e4m3 codes spanning the whole
e4m3 range (N(0, 100) clamped to +-448, as amax/448 block scaling leaves a checkpoint) with random
128x128 f32 block scales (K^-0.5 / 100 * 10**U(-0.3, 0.3)), built directly on the GPU (DeepSeek-V3: 11.3 GB of codes;
quantizing bf16 weights would take longer than the test). Hidden states are random with per-row
magnitudes over one decade and outlier columns; logits carry a per-expert offset, so expert
loads are ragged and small T leaves most experts empty.

Reference (``cute_moe.testing.reference_moe``): the math of ``reference.fused_moe_routed_ref`` on
``reference.route_ref``'s top-k -- activations quantized to e4m3 with 1x128 f32 scales by
``reference.quant_fp8_ref`` as ``permute_quant`` / ``silu_mul_quant`` do, GEMM outputs rounded
to bf16 as the kernel writes them, SwiGLU in f32, the weighted sum in f32 in slot order, one
bf16 rounding -- computed per touched expert (only those experts' weights are dequantized, one
at a time) with IEEE f32 matmuls on the GPU instead of the exact per-128-block sums of
``grouped_gemm_fp8_ref`` (f32 rounding in the GEMMs, which after the bf16 and e4m3 roundings leaves
the two layers a few 1e-4 apart; ``test_reference_moe_matches_the_cute_moe_reference`` checks it).

Acceptance: the output comes from a NaN-poisoned allocator (``moe_cases.poison_pools``, sized to
hold every intermediate of the layer, after ``empty_cache`` so nothing unpoisoned is cached);
no non-finite value; relative L2 error <= 1e-2 over all tokens; every token within 5e-2 of its
own norm (a single misrouted or misplaced token cannot hide in a T=4096 total; typical per-token
errors are a few 1e-3).

Also: expert parallelism (two shards' outputs sum to the unsharded layer within bf16 rounding;
each shard against the reference; ``fused_moe_routed`` with the op's own top-k bit-identical to
``fused_moe``), gate_first=False with ue8m0 activation scales, a CUDA graph captured once at
T = 1, 8, 64 and replayed on new inputs copied into its input buffers (bit-identical to eager),
``torch.compile(fullgraph=True, dynamic=True)`` of a module around ``cute_moe.FusedMoE`` (one
graph for three T, bit-identical to eager), ``FusedMoE.from_bf16`` on the GPU, and the
``cute_moe.FusedMoE`` module itself for the four models at every T (built with ``from_fp8`` over the
same weights, no copy), against the same reference and bounds as ``fused_moe``.

Run time: expected 1-1.5 minutes on an H200 (an estimate, not yet measured: weight generation
~2 s, ~20 kernel variants compiled once per process at ~1 s each, inductor ~10-20 s, each T=4096
reference well under a second). Peak GPU memory ~20 GB (the four models' weights, 15 GB, stay
cached for the module and are freed at its end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from torch import nn

import cute_moe
from cute_moe import FusedMoE
from cute_moe import reference as R
from cute_moe.testing import random_fp8_experts, reference_moe

from .moe_cases import poison_pools

pytestmark = [
    pytest.mark.gpu,
    # inductor still calls torch.jit.script_method
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

BLOCK = 128
FP8 = torch.float8_e4m3fn
ALIGNMENT = 128  # fused_moe's row alignment (the grouped GEMM's tile M)
REL_L2 = 1e-2
TOKEN_REL_L2 = 5e-2
TOKENS = (0, 1, 5, 256, 4096)
DEVICE = "cuda"  # a module constant: the helpers can be tried on the CPU by hand


@dataclass(frozen=True)
class Model:
    name: str
    E: int
    H: int
    I: int
    top_k: int
    routing: str
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    has_bias: bool = False
    logits_dtype: torch.dtype = torch.bfloat16


MODELS = {
    "deepseek_v3": Model("DeepSeek-V3", 256, 7168, 2048, 8, "deepseek_v3", 8, 4, 2.5, True, torch.float32),
    "qwen3_30b_a3b": Model("Qwen3-30B-A3B", 128, 2048, 768, 8, "renormalize"),
    "mixtral_8x7b": Model("Mixtral-8x7B", 8, 4096, 14336, 2, "renormalize"),
    "llama4_scout": Model("Llama-4-Scout", 16, 5120, 8192, 1, "llama4"),
}


# ----------------------------------------------------------------------------- weights and inputs


@dataclass
class Weights:
    w13: torch.Tensor  # e4m3 [E, 2I, H], gate rows first
    s13: torch.Tensor  # f32 [E, 2I/128, H/128]
    w2: torch.Tensor  # e4m3 [E, H, I]
    s2: torch.Tensor  # f32 [E, H/128, I/128]
    bias: Optional[torch.Tensor]  # f32 [E] (deepseek_v3)
    skew: torch.Tensor  # f32 [E]: per-expert logit offset, so expert loads are uneven


_WEIGHTS: dict[str, Weights] = {}


def weights(key: str) -> Weights:
    """The model's random FP8 weights, built once per module (DeepSeek-V3: ~1 s, 11.3 GB)."""
    if key not in _WEIGHTS:
        m = MODELS[key]
        g = torch.Generator(device=DEVICE).manual_seed(sum(map(ord, key)))
        w13, s13 = random_fp8_experts(m.E, 2 * m.I, m.H, g, DEVICE)
        w2, s2 = random_fp8_experts(m.E, m.H, m.I, g, DEVICE)
        bias = 0.1 * torch.randn(m.E, generator=g, device=DEVICE) if m.has_bias else None
        skew = torch.randn(m.E, generator=g, device=DEVICE)
        _WEIGHTS[key] = Weights(w13, s13, w2, s2, bias, skew)
    return _WEIGHTS[key]


@pytest.fixture(scope="module", autouse=True)
def _free_weights():
    yield
    _WEIGHTS.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_inputs(m: Model, w: Weights, T: int, seed: int, same_experts: bool = False):
    """(x bf16 [T, H], router_logits [T, E] in the model's logits dtype), fresh random.

    ``same_experts``: every token has the same logits (one hot set of k experts).
    """
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, m.H, generator=g, device=DEVICE)
    x *= torch.pow(10.0, torch.empty(T, 1, device=DEVICE).uniform_(-0.5, 0.5, generator=g))
    x[:, ::97] *= 8.0  # outlier channels: groups whose scale one element sets
    rows = 1 if (same_experts and T > 0) else T
    logits = torch.randn(rows, m.E, generator=g, device=DEVICE).expand(T, m.E) + w.skew
    return x.to(torch.bfloat16), logits.to(m.logits_dtype).contiguous()


def run_layer(m: Model, w: Weights, x, logits, *, experts: slice = slice(None), expert_offset: int = 0, **kw):
    """cute_moe.fused_moe over the experts ``experts`` of ``w`` (a view, no copy)."""
    return cute_moe.fused_moe(
        x, logits, w.w13[experts], w.s13[experts], w.w2[experts], w.s2[experts], m.top_k, m.routing,
        score_bias=w.bias, n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.scaling,
        expert_offset=expert_offset, num_experts=m.E, **kw,
    )  # fmt: skip


def route_ref(m: Model, w: Weights, logits):
    return R.route_ref(logits, m.top_k, m.routing, w.bias, m.n_group, m.topk_group, m.scaling)


# ----------------------------------------------------------------------------- the reference


def layer_reference(m: Model, w: Weights, x, logits, *, experts: slice = slice(None), expert_offset: int = 0,
                    **kw) -> torch.Tensor:  # fmt: skip
    ids, wts = route_ref(m, w, logits)
    kw.setdefault("apply_router_weight_on_input", m.routing == "llama4")  # fused_moe's default
    return reference_moe(x, ids, wts, w.w13[experts], w.s13[experts], w.w2[experts], w.s2[experts],
                         expert_offset=expert_offset, **kw)  # fmt: skip


# ----------------------------------------------------------------------------- checks


def poison_for_layer(T: int, k: int, e_local: int, H: int, I: int) -> None:
    """Empty the allocator's cache, then poison enough of it to hold every intermediate and the output."""
    M = R.m_cap(T, k, e_local, ALIGNMENT)
    nbytes = (
        M * (H + 4 * (H // BLOCK))  # a, a_scale
        + M * 2 * I * 2  # h
        + M * (I + 4 * (I // BLOCK))  # a2, a2_scale
        + M * H * 2  # y
        + T * H * 2  # out
        + M * 4 + T * k * 16 + 4 * (e_local + 1) * 2  # index maps, top-k
    )
    torch.cuda.empty_cache()
    poison_pools(max(256 << 20, int(nbytes * 1.25) + (64 << 20)))


def check_layer(out: torch.Tensor, ref: torch.Tensor, what: str, diag: Callable[[], str] = lambda: "") -> None:
    assert out.shape == ref.shape and out.dtype == torch.bfloat16, (what, out.shape, out.dtype)
    if ref.numel() == 0:
        return
    o, r = out.float(), ref.float()
    bad = int((~torch.isfinite(o)).sum())
    assert bad == 0, f"{what}: {bad} non-finite outputs (unwritten, or poisoned memory read){diag()}"
    diff_t, ref_t = (o - r).norm(dim=1), r.norm(dim=1)
    rel = (diff_t.square().sum() / ref_t.square().sum().clamp_min(1e-30)).sqrt().item()
    assert rel <= REL_L2, f"{what}: relative L2 error {rel:.3e} > {REL_L2}{diag()}"
    worse = diff_t > TOKEN_REL_L2 * ref_t
    n_worse = int(worse.sum())
    assert n_worse == 0, (
        f"{what}: {n_worse} of {o.shape[0]} tokens off by more than {TOKEN_REL_L2} of their norm "
        f"(first: token {int(worse.nonzero()[0])}); total rel L2 {rel:.3e}{diag()}"
    )


def route_diag(m: Model, w: Weights, logits) -> Callable[[], str]:
    """On failure: how many tokens the route kernel sends to other experts than route_ref does."""

    def diag() -> str:
        ids, _ = cute_moe.route(logits, m.top_k, m.routing, score_bias=w.bias, n_group=m.n_group,
                                topk_group=m.topk_group, routed_scaling_factor=m.scaling)  # fmt: skip
        want, _ = route_ref(m, w, logits)
        differ = int((ids.sort(dim=1).values != want.sort(dim=1).values).any(dim=1).sum())
        return f" [route kernel vs route_ref: {differ} of {logits.shape[0]} tokens pick other experts]"

    return diag


# ----------------------------------------------------------------------------- the reference itself


def test_reference_moe_matches_the_cute_moe_reference():
    """reference_moe (f32 matmuls, per touched expert) vs reference.fused_moe_routed_ref (exact
    128-wide block sums) on a small layer, whole and as an expert-parallel shard."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    E, H, I, k, T = 8, 256, 384, 2, 37
    w13, s13 = random_fp8_experts(E, 2 * I, H, g, DEVICE)
    w2, s2 = random_fp8_experts(E, H, I, g, DEVICE)
    x = (torch.randn(T, H, generator=g, device=DEVICE) * 3).to(torch.bfloat16)
    ids, wts = R.route_ref(torch.randn(T, E, generator=g, device=DEVICE), k, "renormalize")
    for sl, off in ((slice(None), 0), (slice(3, 7), 3)):
        for fmt, gate_first, on_input in ((None, True, False), ("ue8m0", False, False), (None, True, True)):
            want = R.fused_moe_routed_ref(x, ids, wts, w13[sl], s13[sl], w2[sl], s2[sl], off, gate_first, fmt,
                                          on_input)  # fmt: skip
            got = reference_moe(x, ids, wts, w13[sl], s13[sl], w2[sl], s2[sl], expert_offset=off, gate_first=gate_first,
                                act_scale_fmt=fmt, apply_router_weight_on_input=on_input)  # fmt: skip
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel <= 2e-3, (off, fmt, rel)


# ----------------------------------------------------------------------------- the layer vs the reference


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_matches_reference(model: str, T: int):
    m, w = MODELS[model], weights(model)
    x, logits = make_inputs(m, w, T, seed=1000 * T + sum(map(ord, model)))
    ref = layer_reference(m, w, x, logits)
    poison_for_layer(T, m.top_k, m.E, m.H, m.I)
    out = run_layer(m, w, x, logits)
    assert out.shape == (T, m.H) and out.dtype == torch.bfloat16
    check_layer(out, ref, f"{m.name} T={T}", route_diag(m, w, logits))


def fused_moe_module(m: Model, w: Weights) -> FusedMoE:
    """The model's layer as a cute_moe.FusedMoE over the weights ``w`` (from_fp8 keeps contiguous
    tensors as they are: the buffers are the same storage, checked, so DeepSeek-V3's 11.3 GB of
    codes are not copied)."""
    layer = FusedMoE.from_fp8(w.w13, w.s13, w.w2, w.s2, top_k=m.top_k, num_experts=m.E, routing_method=m.routing,
                              n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.scaling,
                              score_bias=w.bias)  # fmt: skip
    assert layer.w13.data_ptr() == w.w13.data_ptr() and layer.w2.data_ptr() == w.w2.data_ptr()
    return layer


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("model", list(MODELS))
def test_fused_moe_module_matches_reference(model: str, T: int):
    """cute_moe.FusedMoE's forward for each model (its routing method, groups, score bias, scaling
    and Llama-4's input-side router weight are the module's defaults for those options, as
    fused_moe's) against the reference of the layer, with the bounds of
    test_fused_moe_matches_reference; fresh inputs (other seeds than that test's).  For even T > 0
    the hidden states come as [2, T/2, H] with logits [2, T/2, E] (a model's [batch, seq, H]): the
    module flattens the leading dims and gives them back."""
    m, w = MODELS[model], weights(model)
    layer = fused_moe_module(m, w)
    x, logits = make_inputs(m, w, T, seed=1000 * T + sum(map(ord, model)) + 77)
    ref = layer_reference(m, w, x, logits)
    lead = (2, T // 2) if T and T % 2 == 0 else (T,)
    poison_for_layer(T, m.top_k, m.E, m.H, m.I)
    out = layer(x.view(*lead, m.H), logits.view(*lead, m.E))
    assert out.shape == (*lead, m.H) and out.dtype == torch.bfloat16
    check_layer(out.reshape(T, m.H), ref, f"FusedMoE {m.name} T={T}", route_diag(m, w, logits))


@pytest.mark.parametrize("T", [1, 256])
def test_llama4_router_weight_on_input_and_on_output(T: int):
    """Llama-4 Scout: fused_moe weights the input by default (HF's convention), the outputs with
    apply_router_weight_on_input=False, and fused_moe_routed does either when told; each against the
    reference of its own convention."""
    m, w = MODELS["llama4_scout"], weights("llama4_scout")
    x, logits = make_inputs(m, w, T, seed=77 + T)
    ids, wts = route_ref(m, w, logits)
    for on_input in (True, False):
        ref = layer_reference(m, w, x, logits, apply_router_weight_on_input=on_input)
        poison_for_layer(T, m.top_k, m.E, m.H, m.I)
        out = run_layer(m, w, x, logits, apply_router_weight_on_input=on_input)
        check_layer(out, ref, f"{m.name} T={T} fused_moe on_input={on_input}", route_diag(m, w, logits))
        poison_for_layer(T, m.top_k, m.E, m.H, m.I)
        routed = cute_moe.fused_moe_routed(x, ids, wts, w.w13, w.s13, w.w2, w.s2, apply_router_weight_on_input=on_input)
        check_layer(routed, ref, f"{m.name} T={T} fused_moe_routed on_input={on_input}")


def test_router_weight_on_input_top_k_2():
    """The input-side convention with k > 1 (each slot a token of its own): Mixtral's shapes with
    llama4 routing at top-2, through fused_moe_routed, whole and as two expert-parallel shards."""
    m, w = MODELS["mixtral_8x7b"], weights("mixtral_8x7b")
    x, logits = make_inputs(m, w, 256, seed=99)
    ids, wts = R.route_ref(logits, 2, "llama4")
    ref = reference_moe(x, ids, wts, w.w13, w.s13, w.w2, w.s2, apply_router_weight_on_input=True)
    poison_for_layer(256, 2, m.E, m.H, m.I)
    out = cute_moe.fused_moe_routed(x, ids, wts, w.w13, w.s13, w.w2, w.s2, apply_router_weight_on_input=True)
    check_layer(out, ref, "llama4 top-2 on input")
    half = m.E // 2
    shards = [cute_moe.fused_moe_routed(x, ids, wts, w.w13[sl], w.s13[sl], w.w2[sl], w.s2[sl], expert_offset=off,
                                        apply_router_weight_on_input=True).float()
              for sl, off in ((slice(0, half), 0), (slice(half, None), half))]  # fmt: skip
    check_layer((shards[0] + shards[1]).to(torch.bfloat16), ref, "llama4 top-2 on input, two shards summed")


def test_fused_moe_fp16_hidden_states():
    """fp16 x (values a bf16 can hold, so both quantize alike) gives the bf16 layer's output in fp16."""
    m, w = MODELS["qwen3_30b_a3b"], weights("qwen3_30b_a3b")
    x, logits = make_inputs(m, w, 256, seed=88)
    want = run_layer(m, w, x, logits)
    poison_for_layer(256, m.top_k, m.E, m.H, m.I)
    out = run_layer(m, w, x.half(), logits)
    assert out.dtype == torch.float16 and torch.equal(out, want.half())
    # an fp16 model's router gives fp16 logits: routed as their exact f32 values
    assert torch.equal(run_layer(m, w, x.half(), logits.half()), run_layer(m, w, x.half(), logits.half().float()))


def test_fused_moe_gate_second_and_ue8m0_scales():
    """gate_first=False (FlashInfer's half order: the same codes read as up rows first) with
    power-of-two activation scales, against the reference with the same options."""
    m, w = MODELS["qwen3_30b_a3b"], weights("qwen3_30b_a3b")
    x, logits = make_inputs(m, w, 256, seed=77)
    opts = dict(gate_first=False, act_scale_fmt="ue8m0")
    ref = layer_reference(m, w, x, logits, **opts)
    poison_for_layer(256, m.top_k, m.E, m.H, m.I)
    check_layer(run_layer(m, w, x, logits, **opts), ref, "gate_first=False, ue8m0", route_diag(m, w, logits))


# ----------------------------------------------------------------------------- expert parallelism


# model -> two shards (expert_offset, local experts) covering [0, E)
EP_SHARDS = {
    "deepseek_v3": ((0, 128), (128, 128)),
    "qwen3_30b_a3b": ((0, 48), (48, 80)),  # uneven
}


@pytest.mark.parametrize("model", list(EP_SHARDS))
def test_expert_parallel_shards_sum_to_the_unsharded_layer(model: str):
    """Each shard sees the global logits and computes only its experts' slots; the two outputs
    summed equal the unsharded output within bf16 rounding: every GEMM row is the same on both
    (same rows, same 128-row tiles), only the f32 sum over the k slots is split and each part
    rounded to bf16, so |s0 + s1 - full| <= 2^-8 (|s0| + |s1| + |full|) (unit roundoff of bf16)."""
    m, w = MODELS[model], weights(model)
    T = 256
    x, logits = make_inputs(m, w, T, seed=4242 + len(model))
    ref = layer_reference(m, w, x, logits)
    poison_for_layer(T, m.top_k, m.E, m.H, m.I)
    full = run_layer(m, w, x, logits)
    check_layer(full, ref, f"{m.name} unsharded", route_diag(m, w, logits))
    parts = []
    for off, n in EP_SHARDS[model]:
        sl = slice(off, off + n)
        ref = layer_reference(m, w, x, logits, experts=sl, expert_offset=off)
        poison_for_layer(T, m.top_k, n, m.H, m.I)
        part = run_layer(m, w, x, logits, experts=sl, expert_offset=off)
        check_layer(part, ref, f"{m.name} shard [{off}, {off + n})", route_diag(m, w, logits))
        parts.append(part.float())
        # the same shard from a precomputed top-k: bit-identical
        ids, wts = cute_moe.route(logits, m.top_k, m.routing, score_bias=w.bias, n_group=m.n_group,
                                  topk_group=m.topk_group, routed_scaling_factor=m.scaling)  # fmt: skip
        routed = cute_moe.fused_moe_routed(x, ids, wts, w.w13[sl], w.s13[sl], w.w2[sl], w.s2[sl], expert_offset=off)
        assert torch.equal(routed, part), f"fused_moe_routed differs from fused_moe on shard [{off}, {off + n})"
        # given the global expert count (a launch hint, as fused_moe passes it): the same bits
        hinted = cute_moe.fused_moe_routed(x, ids, wts, w.w13[sl], w.s13[sl], w.w2[sl], w.s2[sl], expert_offset=off,
                                           num_experts=m.E)  # fmt: skip
        assert torch.equal(hinted, part), f"fused_moe_routed(num_experts=) differs on shard [{off}, {off + n})"
    s0, s1 = parts
    f = full.float()
    bound = 2.0**-8 * (s0.abs() + s1.abs() + f.abs()) * 1.001 + 1e-4 * f.abs().amax(dim=1, keepdim=True)
    over = (s0 + s1 - f).abs() > bound
    assert int(over.sum()) == 0, (
        f"{int(over.sum())} of {over.numel()} elements: shard sum differs from the unsharded layer by more than "
        f"bf16 rounding (max abs diff {(s0 + s1 - f).abs().max().item():.3e})"
    )


def test_expert_parallel_hint_changes_the_launch_not_the_output():
    """An EP8-like slice (32 of DeepSeek-V3's 256 experts) at T = 4096: M_cap's estimate counts every
    routed row as local and keeps 32 experts on the 128-wide tiles (the SwiGLU kernel's pair-split
    form); the global
    expert count (fused_moe's own, or fused_moe_routed's ``num_experts``) gives 128 rows per expert:
    the 256-wide tile paired along M and the fused SwiGLU kernel.  The outputs are the same bits."""
    from cute_moe.kernels import grouped_gemm_schedule as gs  # noqa: PLC0415

    m, w = MODELS["deepseek_v3"], weights("deepseek_v3")
    T, sl, e_local = 4096, slice(32, 64), 32
    m_cap, expected_m = R.m_cap(T, m.top_k, e_local, ALIGNMENT), T * m.top_k // m.E
    assert gs.sm90_swiglu_tile(m_cap, e_local, m.H, True) == gs.TILE_N
    assert gs.sm90_swiglu_tile(m_cap, e_local, m.H, True, expected_m) == gs.WIDE_TILE_N
    assert gs.sm90_launch_config(m_cap, e_local, m.I, True, expected_m=expected_m)[2] == gs.WIDE_TILE_N
    x, logits = make_inputs(m, w, T, seed=808)
    ids, wts = cute_moe.route(logits, m.top_k, m.routing, score_bias=w.bias, n_group=m.n_group,
                              topk_group=m.topk_group, routed_scaling_factor=m.scaling)  # fmt: skip
    args = (x, ids, wts, w.w13[sl], w.s13[sl], w.w2[sl], w.s2[sl])
    poison_for_layer(T, m.top_k, e_local, m.H, m.I)
    plain = cute_moe.fused_moe_routed(*args, expert_offset=32)
    poison_for_layer(T, m.top_k, e_local, m.H, m.I)
    hinted = cute_moe.fused_moe_routed(*args, expert_offset=32, num_experts=m.E)
    assert not hinted.isnan().any() and hinted.abs().amax() > 0
    assert torch.equal(plain, hinted)
    assert torch.equal(run_layer(m, w, x, logits, experts=sl, expert_offset=32), hinted)


def test_fused_moe_routed_equals_fused_moe():
    """The op's own top-k through fused_moe_routed (and FusedMoE.forward_routed): bit-identical."""
    m, w = MODELS["deepseek_v3"], weights("deepseek_v3")
    x, logits = make_inputs(m, w, 256, seed=99)
    want = run_layer(m, w, x, logits)
    ids, wts = cute_moe.route(logits, m.top_k, m.routing, score_bias=w.bias, n_group=m.n_group,
                              topk_group=m.topk_group, routed_scaling_factor=m.scaling)  # fmt: skip
    assert ids.dtype == torch.int32 and wts.dtype == torch.float32
    poison_for_layer(256, m.top_k, m.E, m.H, m.I)
    got = cute_moe.fused_moe_routed(x, ids, wts, w.w13, w.s13, w.w2, w.s2)
    assert torch.equal(got, want)
    layer = FusedMoE.from_fp8(w.w13, w.s13, w.w2, w.s2, top_k=m.top_k, num_experts=m.E, routing_method=m.routing,
                              n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.scaling,
                              score_bias=w.bias)  # fmt: skip
    assert torch.equal(layer(x, logits), want)
    assert torch.equal(layer.forward_routed(x, ids, wts), want)
    # bf16 weights (an HF router's in a bf16 model): their exact f32 values
    w16 = wts.bfloat16()
    assert torch.equal(layer.forward_routed(x, ids, w16), layer.forward_routed(x, ids, w16.float()))


def test_fused_moe_routed_negative_ids_contribute_nothing():
    """-1 (and any id outside the local range) is not local on the GPU as on the CPU: the same output
    as those slots given weight 0, and the same as the CPU path's."""
    m, w = MODELS["deepseek_v3"], weights("deepseek_v3")
    x, logits = make_inputs(m, w, 64, seed=7)
    ids, wts = cute_moe.route(logits, m.top_k, m.routing, score_bias=w.bias, n_group=m.n_group,
                              topk_group=m.topk_group, routed_scaling_factor=m.scaling)  # fmt: skip
    dropped = torch.rand(ids.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) < 0.3
    got = cute_moe.fused_moe_routed(x, torch.where(dropped, -1, ids), wts, w.w13, w.s13, w.w2, w.s2)
    want = cute_moe.fused_moe_routed(x, ids, torch.where(dropped, 0.0, wts), w.w13, w.s13, w.w2, w.s2)
    assert torch.equal(got, want)
    cpu = cute_moe.fused_moe_routed(*(t.cpu() for t in (x, torch.where(dropped, -1, ids), wts, w.w13, w.s13, w.w2,
                                                        w.s2)))  # fmt: skip
    assert (cpu.float() - got.cpu().float()).norm() <= 1e-2 * cpu.float().norm()


def test_fused_moe_routed_refuses_top_k_over_32_before_launching():
    """finalize's kernel takes k <= 32: fused_moe_routed says so up front, not after the GEMMs ran."""
    fp8 = torch.float8_e4m3fn
    x = torch.randn(2, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (2, 33), device="cuda", dtype=torch.int32)
    wts = torch.rand(2, 33, device="cuda")
    w13, s13 = torch.randn(4, 256, 128, device="cuda").to(fp8), torch.rand(4, 2, 1, device="cuda")
    w2, s2 = torch.randn(4, 128, 128, device="cuda").to(fp8), torch.rand(4, 1, 1, device="cuda")
    with pytest.raises(NotImplementedError, match=r"fused_moe_routed: top_k \(topk_ids\.shape\[1\]\) must be <= 32 on"):
        cute_moe.fused_moe_routed(x, ids, wts, w13, s13, w2, s2)


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("T", [1, 8, 64])
def test_cuda_graph_capture_once_replay_new_inputs(T: int):
    """DeepSeek-V3 at decode sizes: capture fused_moe once, then replay on new hidden states and
    logits copied into the captured input buffers (new routings, the last one sending every token
    to the same 8 experts); each replay bit-identical to an eager call and within the reference."""
    m, w = MODELS["deepseek_v3"], weights("deepseek_v3")
    x_buf, logits_buf = make_inputs(m, w, T, seed=500 + T)
    eager0 = run_layer(m, w, x_buf, logits_buf)  # compiles and loads every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_layer(m, w, x_buf, logits_buf)
    graph.replay()
    assert torch.equal(out, eager0), "replay on the capture's own inputs differs from eager"
    for i, same in enumerate((False, False, True)):
        x, logits = make_inputs(m, w, T, seed=600 + 10 * T + i, same_experts=same)
        x_buf.copy_(x)
        logits_buf.copy_(logits)
        out.fill_(float("nan"))
        graph.replay()
        eager = run_layer(m, w, x, logits)
        check_layer(eager, layer_reference(m, w, x, logits), f"eager T={T} replay {i}", route_diag(m, w, logits))
        assert torch.equal(out, eager), f"replay {i} (T={T}) differs from eager"
    del graph


# ----------------------------------------------------------------------------- torch.compile


class _Block(nn.Module):
    """A model block that hands router logits to a cute_moe.FusedMoE."""

    def __init__(self, moe: FusedMoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.moe(x, router_logits)


def test_torch_compile_fullgraph_dynamic(compile_counter):
    m, w = MODELS["qwen3_30b_a3b"], weights("qwen3_30b_a3b")
    moe = FusedMoE.from_fp8(w.w13, w.s13, w.w2, w.s2, top_k=m.top_k, num_experts=m.E, routing_method=m.routing)
    block = _Block(moe)
    compiled = torch.compile(block, backend=compile_counter, fullgraph=True, dynamic=True)
    frames = None
    for i, T in enumerate((3, 17, 64)):
        x, logits = make_inputs(m, w, T, seed=700 + i)
        got = compiled(x, logits)
        frames = frames or compile_counter.frame_count
        assert compile_counter.frame_count == frames, f"recompiled for T={T}"
        want = block(x, logits)
        assert got.shape == (T, m.H) and got.dtype == torch.bfloat16
        assert torch.equal(got, want), f"compiled differs from eager at T={T}"
        check_layer(got, layer_reference(m, w, x, logits), f"compiled T={T}", route_diag(m, w, logits))
    graphs = [g for g in compile_counter.graphs if "cute_moe" in g.code]
    assert len(graphs) == 1, [g.code for g in compile_counter.graphs]


# ----------------------------------------------------------------------------- FusedMoE.from_bf16


def test_from_bf16_on_gpu_matches_reference():
    """Qwen3-30B-A3B from bf16 weights on the GPU: the buffers are reference.quant_block_128x128_ref's
    codes and scales bit for bit, and the layer matches the reference on them."""
    m = MODELS["qwen3_30b_a3b"]
    g = torch.Generator(device=DEVICE).manual_seed(31)
    w13 = (torch.randn(m.E, 2 * m.I, m.H, generator=g, device=DEVICE) * m.H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(m.E, m.H, m.I, generator=g, device=DEVICE) * m.I**-0.5).to(torch.bfloat16)
    layer = FusedMoE.from_bf16(w13, w2, top_k=m.top_k, routing_method=m.routing)
    assert layer.w13.device.type == DEVICE and layer.w13.dtype == FP8
    for name, (q, s) in (("w13", R.quant_block_128x128_ref(w13)), ("w2", R.quant_block_128x128_ref(w2))):
        assert torch.equal(getattr(layer, name).view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(getattr(layer, name + "_scale"), s), name + "_scale"
    del w13, w2
    T = 256
    gi = torch.Generator(device=DEVICE).manual_seed(32)
    x = torch.randn(T, m.H, generator=gi, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(T, m.E, generator=gi, device=DEVICE).to(torch.bfloat16)
    ids, wts = R.route_ref(logits, m.top_k, m.routing)
    ref = reference_moe(x, ids, wts, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)
    poison_for_layer(T, m.top_k, m.E, m.H, m.I)
    check_layer(layer(x, logits), ref, "from_bf16")
