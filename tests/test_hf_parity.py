"""cute_moe.FusedMoE against HuggingFace transformers' own MoE blocks (small random configs), on the
CPU (the ops' CPU path, in CI) and on the GPU (the CuTe DSL kernels; marked ``gpu``).

For DeepseekV3MoE, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, Llama4TextMoe and
MiniMaxM2SparseMoeBlock: the HF block gets *our* dequantized FP8 expert weights
(``dequant_block_128x128_ref`` of the 128x128-quantized weights, so both sides use the identical
weights), runs in float32, and sees the same hidden states. Checked:

* routing: the HF router's top-k ids equal ours (as sets per token: HF's ``torch.topk(sorted=False)``
  order is unspecified) and its weights equal ours to 1e-6; our layer gets the HF router's logits;
* the layer output, within the FP8-activation tolerance derived below;
* the expert path alone on FP8-rounded inputs, within a tighter bound.

DeepSeek-V3's shared expert is not part of ``FusedMoE``: its output (HF's own ``shared_experts``
module, f32) is added to ours, as a model would, and compared with the HF block's full output.

Tolerance. Our path quantizes activations to FP8 e4m3 twice (the input x, 1x128 groups, before
GEMM1; the SwiGLU output before GEMM2), HF's runs in f32. One e4m3 rounding with a per-128 amax
scale has a relative L2 error eps ~ 2.3-2.6% (3 mantissa bits: the error is uniform in +-ulp/2,
ulp/|x| in (2^-4, 2^-3], RMS ~ 2^-3.5/sqrt(12); measured 2.6% on Gaussian rows, 2.3% on
silu(g)*u). The error of x reaches both the gate and the up projection, so silu(gate)*up carries
~sqrt(2)*eps ~ 3.7%, and the second quantization adds its own eps: sqrt(0.037^2 + 0.023^2) ~ 4.3%
relative L2 on the output (the bf16 roundings of h, y and out add ~0.2%), which is what these tests
measure (4.0-4.5% over seeds and models). Bound: ``REL_L2 = 6e-2`` (1.4x the prediction) for the whole
output and 0.1 for any single token (H = 256 elements: a noisier estimate, measured <= 6.4%).
Feeding HF the FP8-rounded input ``dequant(quant_fp8(x))`` instead (same routing) leaves only the
second quantization: predicted ~2.3%, measured 2.2-2.4%, bound ``REL_L2_XQ = 3.5e-2`` (per token 0.05).
A wrong expert, a swapped gate/up half or a wrong routing weight gives errors of order 1.

Devices. Every test runs twice: ``cpu`` and ``cuda`` (marked ``gpu``, skipped without CUDA). The HF
block always runs on the CPU in f32 (where it is cheapest); our layer runs on the device under test
(its buffers loaded or moved there), and the comparisons happen on that device (HF's outputs moved
there). On the GPU our layer's outputs come from a NaN-poisoned allocator and must be finite.
The output bounds are the same on both: the GPU kernels compute what the CPU path computes (the
same e4m3 quantizer with 1x128 f32 scales, codes identical on >= 99.99% of elements, bf16 GEMM
outputs, SwiGLU and the weighted sum in f32); they differ only in the order of the f32 sums
(~1e-6 relative per GEMM output, a few 1e-4 after the bf16 and e4m3 roundings it can flip), two
orders below the 4.3% the bounds are derived from. The routing weights' bound differs: the CPU
path's route is ``reference.route_ref`` (torch's softmax / sigmoid on the same f32 logits as HF,
agreeing to 1e-6); the route kernel's sums run in another order than torch's and its contract
against ``route_ref`` is 1e-5 relative (``tests/test_gpu_route.py``), so on the GPU the weights are
checked to rtol 1e-5 (atol 1e-6 as on the CPU); a wrong weight is off by ~1e-1. Ids are identical
on both.
"""

from __future__ import annotations

import pytest
import torch

from cute_moe import FusedMoE
from cute_moe import reference as R

from .moe_cases import poison_pools

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, T = 256, 128, 32
REL_L2, REL_L2_TOKEN = 6e-2, 0.1
REL_L2_XQ, REL_L2_XQ_TOKEN = 3.5e-2, 0.05
# routing weights against HF's: (rtol, atol) per device (see the module docstring)
ROUTE_TOL = {"cpu": (1e-6, 1e-6), "cuda": (1e-5, 1e-6)}
DEVICES = pytest.mark.parametrize(
    "device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
)


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error on got's device (want, HF's CPU output, is moved there)."""
    got, want = got.double(), want.to(got.device).double()
    return ((got - want).norm() / want.norm()).item()


def _rel_l2_token(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.to(got.device).double()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


def _ours(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Our layer on its buffers' device, on x and the logits moved there. On the GPU the output comes
    from a NaN-poisoned allocator (emptied first, so nothing unpoisoned is cached): an element left
    unwritten, or a poisoned intermediate read, is non-finite."""
    dev = layer.w13.device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        poison_pools(64 << 20)
    out = layer(x.to(dev), logits.to(dev))
    assert out.device == dev and bool(torch.isfinite(out).all()), "non-finite output (unwritten, or poison read)"
    return out


def _dequant(layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's FP8 weights dequantized in f32 on the CPU (w13 [E, 2I, H], w2 [E, H, I]), for the HF block."""
    return (R.dequant_block_128x128_ref(layer.w13.cpu(), layer.w13_scale.cpu()),
            R.dequant_block_128x128_ref(layer.w2.cpu(), layer.w2_scale.cpu()))  # fmt: skip


def _eager(config):
    # transformers >= 5 dispatches the experts' forward on config._experts_implementation
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return config


def _set_hf_experts(block, w13: torch.Tensor, w2: torch.Tensor, names: tuple[str, str, str]) -> None:
    """Put f32 expert weights (w13 [E, 2I, H] gate rows first, w2 [E, H, I]) into the HF block.

    transformers >= 5 stores them fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I], possibly transposed); 4.x has a ModuleList of per-expert MLPs."""
    experts = block.experts
    inter = w13.shape[1] // 2
    with torch.no_grad():
        if hasattr(experts, "gate_up_proj"):
            assert getattr(experts, "is_concatenated", True), "interleaved gate/up layout not handled"
            transposed = getattr(experts, "is_transposed", False)
            gu, dn = (w13.transpose(1, 2), w2.transpose(1, 2)) if transposed else (w13, w2)
            assert experts.gate_up_proj.shape == gu.shape and experts.down_proj.shape == dn.shape
            experts.gate_up_proj.copy_(gu)
            experts.down_proj.copy_(dn)
        else:
            for e, mlp in enumerate(experts):
                getattr(mlp, names[0]).weight.copy_(w13[e, :inter])
                getattr(mlp, names[1]).weight.copy_(w13[e, inter:])
                getattr(mlp, names[2]).weight.copy_(w2[e])


def _hf_route(block, x: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(router_logits f32 [T, E], topk_weights [T, k], topk_ids [T, k]) from the HF block's router.

    transformers >= 5: the router module returns all three. 4.x: Mixtral / Qwen3 have a Linear gate
    (logits; the top-k is the block's softmax -> topk -> renormalize, recomputed here), DeepSeek-V3's
    router returns (ids, weights)."""
    out = block.gate(x)
    if isinstance(out, tuple) and len(out) == 3:
        return out[0].float(), out[1].float(), out[2]
    if isinstance(out, tuple) and len(out) == 2:
        ids, w = out
        return torch.nn.functional.linear(x.float(), block.gate.weight.float()), w.float(), ids
    logits = out.float()
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w, ids


def _check_routing(layer: FusedMoE, logits: torch.Tensor, hf_w: torch.Tensor, hf_ids: torch.Tensor) -> None:
    """Our layer's top-k (on its device) against HF's (moved there): ids as sets, weights to ROUTE_TOL."""
    dev = layer.w13.device
    ids, w = layer.route(logits.to(dev))
    hf_w, hf_ids = hf_w.to(dev), hf_ids.to(dev)
    ours_order, hf_order = ids.long().argsort(dim=1), hf_ids.long().argsort(dim=1)
    assert torch.equal(ids.long().gather(1, ours_order), hf_ids.long().gather(1, hf_order)), "top-k ids differ"
    rtol, atol = ROUTE_TOL[dev.type]
    torch.testing.assert_close(w.gather(1, ours_order), hf_w.gather(1, hf_order), rtol=rtol, atol=atol)


def _check_outputs(layer: FusedMoE, block, x: torch.Tensor, logits, hf_w, hf_ids, got, want) -> None:
    err, err_tok = _rel_l2(got, want), _rel_l2_token(got, want)
    assert err <= REL_L2 and err_tok <= REL_L2_TOKEN, (err, err_tok)
    if not hasattr(block.experts, "gate_up_proj"):  # 4.x experts: no (x, ids, weights) entry point
        return
    q, s = R.quant_fp8_ref(x)
    xq = q.float() * s.repeat_interleave(128, dim=1)  # exactly what our first GEMM multiplies
    with torch.no_grad():
        want_q = block.experts(xq, hf_ids, hf_w)
    routed = _ours(layer, x, logits)
    err, err_tok = _rel_l2(routed, want_q), _rel_l2_token(routed, want_q)
    assert err <= REL_L2_XQ and err_tok <= REL_L2_XQ_TOKEN, (err, err_tok)


def _weights(g: torch.Generator, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    return w13, w2


def _hf_checkpoint(layer: FusedMoE, prefix: str, gate_weight: torch.Tensor, bias, names) -> dict:
    """The layer in the HF DeepSeek-V3 FP8 checkpoint format (gate rows first in w13)."""
    sd = {f"{prefix}gate.weight": gate_weight.bfloat16()}
    if bias is not None:
        sd[f"{prefix}gate.e_score_correction_bias"] = bias
    for e in range(layer.num_local_experts):
        for name, w, s in ((names[0], layer.w13[e, :I], layer.w13_scale[e, : I // 128]),
                           (names[1], layer.w13[e, I:], layer.w13_scale[e, I // 128 :]),
                           (names[2], layer.w2[e], layer.w2_scale[e])):  # fmt: skip
            sd[f"{prefix}experts.{e}.{name}.weight"] = w.contiguous()
            sd[f"{prefix}experts.{e}.{name}.weight_scale_inv"] = s.contiguous()
    return sd


# ----------------------------------------------------------------------------- DeepSeek-V3


def _deepseek_block(E: int, top_k: int, n_group: int, topk_group: int, scaling: float):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=top_k,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling,
                           norm_topk_prob=True, n_shared_experts=1, hidden_act="silu")  # fmt: skip
    return DeepseekV3MoE(_eager(cfg)).float().eval()


@DEVICES
@pytest.mark.parametrize("tokens", [1, T])
def test_deepseek_v3_moe(tokens: int, device: str, tmp_path) -> None:
    """HF FP8 checkpoint (safetensors file) -> FusedMoE.from_hf_fp8 (loaded onto ``device``), against
    DeepseekV3MoE on the dequantized checkpoint; shared expert added from the HF block."""
    E, top_k, n_group, topk_group, scaling = 16, 4, 4, 2, 2.5
    g = torch.Generator().manual_seed(100 + tokens)
    w13, w2 = _weights(g, E)
    bias = torch.randn(E, generator=g) * 0.1
    gate_w = torch.randn(E, H, generator=g) * H**-0.5
    quantized = FusedMoE.from_bf16(w13, w2, top_k=top_k)
    prefix = "model.layers.3.mlp."
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(_hf_checkpoint(quantized, prefix, gate_w, bias, ("gate_proj", "up_proj", "down_proj")),
                                str(path))  # fmt: skip
    layer = FusedMoE.from_hf_fp8(path, prefix, E, top_k, routing_method="deepseek_v3", n_group=n_group,
                                 topk_group=topk_group, routed_scaling_factor=scaling, device=device)  # fmt: skip
    assert layer.w13.device.type == device
    assert layer.score_bias is not None and torch.equal(layer.score_bias.cpu(), bias)

    block = _deepseek_block(E, top_k, n_group, topk_group, scaling)
    _set_hf_experts(block, *_dequant(layer), ("gate_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        block.gate.weight.copy_(gate_w.bfloat16().float())  # the checkpoint's (bf16) router weight
        block.gate.e_score_correction_bias.copy_(bias)
        for lin in (block.shared_experts.gate_proj, block.shared_experts.up_proj, block.shared_experts.down_proj):
            lin.weight.normal_(0.0, lin.in_features**-0.5, generator=g)

    x = torch.randn(tokens, H, generator=g).bfloat16()
    xf = x.float()
    with torch.no_grad():
        logits, hf_w, hf_ids = _hf_route(block, xf, top_k, True)
        want = block(xf[None])[0]
        shared = block.shared_experts(xf)
    _check_routing(layer, logits, hf_w, hf_ids)
    got = _ours(layer, x, logits).float() + shared.to(device)
    _check_outputs(layer, block, x, logits, hf_w, hf_ids, got, want)

    # expert parallelism: two ranks loaded from the same file sum to the same layer
    ranks = [FusedMoE.from_hf_fp8(path, prefix, E, top_k, routing_method="deepseek_v3", n_group=n_group,
                                  topk_group=topk_group, routed_scaling_factor=scaling, expert_offset=o,
                                  num_local_experts=E // 2, device=device) for o in (0, E // 2)]  # fmt: skip
    got_ep = sum(_ours(r, x, logits).float() for r in ranks) + shared.to(device)
    err, err_tok = _rel_l2(got_ep, want), _rel_l2_token(got_ep, want)
    assert err <= REL_L2 and err_tok <= REL_L2_TOKEN, (err, err_tok)


# ----------------------------------------------------------------------------- Qwen3-MoE


@DEVICES
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_sparse_block(norm_topk_prob: bool, device: str) -> None:
    """Qwen3MoeSparseMoeBlock: softmax -> top-k (-> renormalize when norm_topk_prob, as Qwen3-30B-A3B and
    Qwen3-235B-A22B do) = our 'renormalize' ('softmax' without the renormalization)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    E, top_k = 16, 4
    g = torch.Generator().manual_seed(200 + norm_topk_prob)
    w13, w2 = _weights(g, E)
    layer = FusedMoE.from_bf16(w13, w2, top_k=top_k, routing_method="renormalize" if norm_topk_prob else "softmax")
    layer = layer.to(device)  # quantized on the CPU: the same codes on both devices
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k,
                         norm_topk_prob=norm_topk_prob, hidden_act="silu")  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(_eager(cfg)).float().eval()
    _set_hf_experts(block, *_dequant(layer), ("gate_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H, generator=g) * H**-0.5)
    x = torch.randn(T, H, generator=g).bfloat16()
    xf = x.float()
    with torch.no_grad():
        logits, hf_w, hf_ids = _hf_route(block, xf, top_k, norm_topk_prob)
        want = block(xf[None])[0]
    _check_routing(layer, logits, hf_w, hf_ids)
    _check_outputs(layer, block, x, logits, hf_w, hf_ids, _ours(layer, x, logits), want)


# ----------------------------------------------------------------------------- Mixtral


@DEVICES
@pytest.mark.parametrize("gate_first", [True, False])
def test_mixtral_sparse_moe_block(gate_first: bool, device: str) -> None:
    """MixtralSparseMoeBlock (softmax -> top-2 -> renormalize = our 'renormalize'); weights loaded
    through from_hf_fp8 with Mixtral's w1 / w3 / w2 names, in either w13 half order."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    E, top_k = 8, 2
    g = torch.Generator().manual_seed(300 + gate_first)
    w13, w2 = _weights(g, E)
    names = ("w1", "w3", "w2")
    prefix = "model.layers.0.block_sparse_moe."
    gate_w = torch.randn(E, H, generator=g) * H**-0.5
    sd = _hf_checkpoint(FusedMoE.from_bf16(w13, w2, top_k=top_k), prefix, gate_w, None, names)
    layer = FusedMoE.from_hf_fp8(sd, prefix, E, top_k, gate_first=gate_first, proj_names=names, device=device)
    assert layer.w13.device.type == device
    cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k,
                        hidden_act="silu")  # fmt: skip
    block = MixtralSparseMoeBlock(_eager(cfg)).float().eval()
    gate_rows, up_rows = (slice(0, I), slice(I, 2 * I)) if gate_first else (slice(I, 2 * I), slice(0, I))
    w13_f, w2_f = _dequant(layer)
    _set_hf_experts(block, torch.cat([w13_f[:, gate_rows], w13_f[:, up_rows]], dim=1), w2_f, names)
    with torch.no_grad():
        block.gate.weight.copy_(sd[f"{prefix}gate.weight"].float())
    x = torch.randn(T, H, generator=g).bfloat16()
    xf = x.float()
    with torch.no_grad():
        logits, hf_w, hf_ids = _hf_route(block, xf, top_k, True)
        want = block(xf[None])[0]
    _check_routing(layer, logits, hf_w, hf_ids)
    _check_outputs(layer, block, x, logits, hf_w, hf_ids, _ours(layer, x, logits), want)


# ----------------------------------------------------------------------------- Llama-4


@DEVICES
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_text_moe(top_k: int, device: str) -> None:
    """Llama4TextMoe: top-k of the router logits (Llama-4 itself: top-1), the sigmoid of each chosen
    logit applied to that expert's *input* (HF: ``routed_in = hidden_states * router_scores``), the
    convention ``FusedMoE`` takes for routing_method='llama4'. The shared expert is added from the
    HF block, as for DeepSeek-V3. Weighting the outputs instead is ~22% off here at top-1: the last
    check shows the test would catch it."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    E = 16
    g = torch.Generator().manual_seed(400)
    w13, w2 = _weights(g, E)
    layer = FusedMoE.from_bf16(w13, w2, top_k=top_k, routing_method="llama4").to(device)
    cfg = Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k,
                           hidden_act="silu")  # fmt: skip
    block = Llama4TextMoe(_eager(cfg)).float().eval()
    w13_f, w2_f = _dequant(layer)
    assert block.experts.gate_up_proj.shape == (E, H, 2 * I) and block.experts.down_proj.shape == (E, I, H)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w13_f.transpose(1, 2))  # [E, H, 2I], gate columns first
        block.experts.down_proj.copy_(w2_f.transpose(1, 2))
        block.router.weight.copy_(torch.randn(E, H, generator=g) * H**-0.5)
    x = torch.randn(T, H, generator=g).bfloat16()
    xf = x.float()
    with torch.no_grad():
        out, logits = block(xf[None])
        shared = block.shared_expert(xf)
        scores, _ = block.router(xf)
    hf_w, hf_ids = scores.topk(top_k, dim=1)  # the non-zero scores (sigmoid keeps the logits' order)
    _check_routing(layer, logits.float(), hf_w, hf_ids)
    got = _ours(layer, x, logits.float()).float() + shared.to(device)
    err, err_tok = _rel_l2(got, out), _rel_l2_token(got, out)
    assert err <= REL_L2 and err_tok <= REL_L2_TOKEN, (err, err_tok)

    # the expert path alone, on exactly the FP8 input our first GEMM multiplies
    routed_in = torch.zeros(E, T, H)
    for j in range(top_k):
        xs = x * hf_w[:, j : j + 1].bfloat16()  # what our layer quantizes: the score in bf16, as a bf16 router gives it
        q, s = R.quant_fp8_ref(xs)
        routed_in[hf_ids[:, j], torch.arange(T)] = q.float() * s.repeat_interleave(128, dim=1)
    with torch.no_grad():
        want_q = block.experts(routed_in.view(E * T, H)).view(E, T, H).sum(dim=0)
    routed = _ours(layer, x, logits.float())
    err, err_tok = _rel_l2(routed, want_q), _rel_l2_token(routed, want_q)
    assert err <= REL_L2_XQ and err_tok <= REL_L2_XQ_TOKEN, (err, err_tok)

    on_output = FusedMoE.from_fp8(layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, top_k=top_k,
                                  routing_method="llama4", apply_router_weight_on_input=False)  # fmt: skip
    assert _rel_l2(_ours(on_output, x, logits.float()).float() + shared.to(device), out) > 2 * REL_L2


# ----------------------------------------------------------------------------- MiniMax-M2


@DEVICES
def test_minimax_m2_sparse_block(device: str) -> None:
    """MiniMaxM2SparseMoeBlock: sigmoid scores, top-k of scores + a selection bias kept at block level
    (``{prefix}e_score_correction_bias``, not under ``gate.``), weights = the unbiased scores
    renormalized: ``deepseek_v3`` with ``n_group=1``. Loaded through from_hf_fp8 with the checkpoint's
    w1 / w3 / w2 names; without the bias 73% of tokens changed experts in the audit that found it."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    E, top_k = 16, 4
    g = torch.Generator().manual_seed(500)
    w13, w2 = _weights(g, E)
    names = ("w1", "w3", "w2")
    prefix = "model.layers.2.block_sparse_moe."
    gate_w = torch.randn(E, H, generator=g) * H**-0.5
    bias = torch.randn(E, generator=g) * 0.2
    sd = _hf_checkpoint(FusedMoE.from_bf16(w13, w2, top_k=top_k), prefix, gate_w, None, names)
    sd[f"{prefix}e_score_correction_bias"] = bias
    layer = FusedMoE.from_hf_fp8(sd, prefix, E, top_k, routing_method="deepseek_v3", proj_names=names, device=device)
    assert layer.w13.device.type == device
    assert layer.score_bias is not None and torch.equal(layer.score_bias.cpu(), bias)
    cfg = MiniMaxM2Config(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k,
                          hidden_act="silu")  # fmt: skip
    block = MiniMaxM2SparseMoeBlock(_eager(cfg)).float().eval()
    _set_hf_experts(block, *_dequant(layer), names)
    with torch.no_grad():
        block.gate.weight.copy_(gate_w.bfloat16().float())
        block.e_score_correction_bias.copy_(bias)
    x = torch.randn(T, H, generator=g).bfloat16()
    xf = x.float()
    with torch.no_grad():
        logits, hf_w, hf_ids = block.gate(xf, block.e_score_correction_bias)
        want = block(xf[None])[0]
    _check_routing(layer, logits.float(), hf_w.float(), hf_ids)
    _check_outputs(layer, block, x, logits.float(), hf_w.float(), hf_ids, _ours(layer, x, logits.float()), want)
