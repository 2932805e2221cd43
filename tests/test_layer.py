"""cute_moe.FusedMoE on the CPU: constructors (bf16, HF FP8 dict / safetensors), expert-parallel
slices, validation errors, module plumbing and torch.compile(fullgraph=True)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import cute_moe
from cute_moe import FusedMoE
from cute_moe import reference as R

# inductor itself still calls torch.jit.script_method on CPU
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

E, H, I, TOP_K, T = 8, 256, 128, 2, 12
FP8 = torch.float8_e4m3fn
PREFIX = "model.layers.3.mlp."
DSV3 = {"routing_method": "deepseek_v3", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}


def _bf16_weights(g: torch.Generator, e: int = E, h: int = H, i: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H] gate rows first, w2 [E, H, I]), bf16, scaled like a trained layer."""
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).bfloat16()
    return w13, w2


def _inputs(g: torch.Generator, t: int = T, e: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(t, H, generator=g).bfloat16(), torch.randn(t, e, generator=g)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b)


def _hf_state_dict(layer: FusedMoE, prefix: str = PREFIX, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """The layer's weights in the HF DeepSeek-V3 FP8 checkpoint format (plus a router and an unrelated key)."""
    I_ = layer.intermediate_size
    g, u = (slice(0, I_), slice(I_, 2 * I_)) if layer.gate_first else (slice(I_, 2 * I_), slice(0, I_))
    gs, us = (slice(g.start // 128, g.stop // 128), slice(u.start // 128, u.stop // 128))
    sd: dict[str, torch.Tensor] = {}
    for j in range(layer.num_local_experts):
        e = layer.expert_offset + j
        for name, w, s in (
            (names[0], layer.w13[j, g], layer.w13_scale[j, gs]),
            (names[1], layer.w13[j, u], layer.w13_scale[j, us]),
            (names[2], layer.w2[j], layer.w2_scale[j]),
        ):
            sd[f"{prefix}experts.{e}.{name}.weight"] = w.clone()
            sd[f"{prefix}experts.{e}.{name}.weight_scale_inv"] = s.clone()
    sd[f"{prefix}gate.weight"] = torch.randn(layer.num_experts, layer.hidden_size).bfloat16()
    if layer.score_bias is not None:
        sd[f"{prefix}gate.e_score_correction_bias"] = layer.score_bias.clone()
    sd["model.layers.3.input_layernorm.weight"] = torch.ones(layer.hidden_size).bfloat16()
    return sd


def _assert_same_weights(a: FusedMoE, b: FusedMoE) -> None:
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        assert _equal(getattr(a, name), getattr(b, name)), name
    assert (a.score_bias is None) == (b.score_bias is None)
    if a.score_bias is not None:
        assert _equal(a.score_bias, b.score_bias)


# ----------------------------------------------------------------------------- from_bf16


@pytest.mark.parametrize("routing", ["renormalize", "deepseek_v3"])
def test_from_bf16_equals_reference_layer(routing: str) -> None:
    g = torch.Generator().manual_seed(0)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    kw = dict(DSV3) if routing == "deepseek_v3" else {"routing_method": routing}
    bias = torch.randn(E, generator=g) * 0.1 if routing == "deepseek_v3" else None
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, score_bias=bias, **kw)
    assert layer.w13.shape == (E, 2 * I, H) and layer.w13.dtype == FP8
    assert layer.w13_scale.shape == (E, 2 * I // 128, H // 128) and layer.w13_scale.dtype == torch.float32
    assert layer.w2.shape == (E, H, I) and layer.w2_scale.shape == (E, H // 128, I // 128)
    q13, s13 = R.quant_block_128x128_ref(w13)
    q2, s2 = R.quant_block_128x128_ref(w2)
    assert _equal(layer.w13, q13) and _equal(layer.w13_scale, s13)
    assert _equal(layer.w2, q2) and _equal(layer.w2_scale, s2)
    want = R.fused_moe_ref(x, logits, q13, s13, q2, s2, TOP_K, kw.pop("routing_method"), bias, **kw)
    assert _equal(layer(x, logits), want)


def test_from_bf16_and_from_fp8_keep_no_autograd_graph() -> None:
    """HF keeps weights as nn.Parameters: the layer's buffers must not hold their autograd graph
    (memory, and copy.deepcopy refused such buffers)."""
    import copy  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    w13, w2 = (nn.Parameter(w.float()) for w in _bf16_weights(g))
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K)
    q13, s13 = R.quant_block_128x128_ref(w13.detach())
    from_fp8 = FusedMoE.from_fp8(q13, nn.Parameter(s13), *R.quant_block_128x128_ref(w2.detach()), top_k=TOP_K)
    for m in (layer, from_fp8):
        assert all(b.grad_fn is None and not b.requires_grad for b in m.buffers())
        x, logits = _inputs(g)
        assert _equal(copy.deepcopy(m)(x, logits), m(x, logits))


def test_from_bf16_input_forms_and_half_order() -> None:
    """Fused gate-first tensor, (gate, up) stacks, per-expert lists: one set of weights; gate_first=False
    stores up rows first and gives the identical output."""
    g = torch.Generator().manual_seed(1)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    base = FusedMoE.from_bf16(w13, w2, top_k=TOP_K)
    stacks = FusedMoE.from_bf16((w13[:, :I], w13[:, I:]), w2, top_k=TOP_K)
    lists = FusedMoE.from_bf16((list(w13[:, :I]), list(w13[:, I:])), list(w2), top_k=TOP_K)
    f32 = FusedMoE.from_bf16(w13.float(), w2.float(), top_k=TOP_K)
    for other in (stacks, lists, f32):
        _assert_same_weights(base, other)
    up_first = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, gate_first=False)
    assert _equal(up_first.w13[:, :I], base.w13[:, I:]) and _equal(up_first.w13[:, I:], base.w13[:, :I])
    assert _equal(up_first.w13_scale[:, :1], base.w13_scale[:, 1:])
    assert _equal(up_first(x, logits), base(x, logits))


def test_llama4_layer_weights_its_input() -> None:
    """routing_method='llama4' applies the router weight to the input by default (HF Llama-4), through
    forward and forward_routed; ``False`` keeps the outputs weighted."""
    g = torch.Generator().manual_seed(5)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    layer = FusedMoE.from_bf16(w13, w2, top_k=1, routing_method="llama4")
    assert layer.apply_router_weight_on_input and "apply_router_weight_on_input" not in repr(layer)  # the default
    ids, w = layer.route(logits)
    want = R.fused_moe_routed_ref(x, ids, w, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, 0, True, None, True)
    assert _equal(layer(x, logits), want) and _equal(layer.forward_routed(x, ids, w), want)
    on_output = FusedMoE.from_fp8(layer.w13, layer.w13_scale, layer.w2, layer.w2_scale, top_k=1,
                                  routing_method="llama4", apply_router_weight_on_input=False)  # fmt: skip
    assert not on_output.apply_router_weight_on_input and "apply_router_weight_on_input=False" in repr(on_output)
    assert _equal(on_output(x, logits), R.fused_moe_routed_ref(x, ids, w, on_output.w13, on_output.w13_scale,
                                                                on_output.w2, on_output.w2_scale))  # fmt: skip


def test_fp16_hidden_states() -> None:
    """fp16 x gives fp16 out: the bf16 layer's output converted, when x holds the same values."""
    g = torch.Generator().manual_seed(6)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K)
    x, logits = _inputs(g)
    out = layer(x.half(), logits)
    assert out.dtype == torch.float16 and _equal(out, layer(x, logits).half())
    assert _equal(layer(x.half(), logits.half()), layer(x.half(), logits.half().float()))  # fp16 logits too


def test_forward_routed_and_route_match_forward() -> None:
    g = torch.Generator().manual_seed(2)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, score_bias=torch.randn(E, generator=g) * 0.1, **DSV3)
    ids, w = layer.route(logits)
    want_ids, want_w = R.route_ref(logits, TOP_K, "deepseek_v3", layer.score_bias, 4, 2, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    assert _equal(layer.forward_routed(x, ids, w), layer(x, logits))


def test_leading_dims_and_empty_batch() -> None:
    g = torch.Generator().manual_seed(3)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K)
    x, logits = _inputs(g)
    out = layer(x.reshape(3, 4, H), logits.reshape(3, 4, E))
    assert out.shape == (3, 4, H) and _equal(out.reshape(T, H), layer(x, logits))
    ids, w = layer.route(logits)
    assert _equal(layer.forward_routed(x.reshape(2, 6, H), ids.reshape(2, 6, -1), w.reshape(2, 6, -1)).reshape(T, H),
                  layer(x, logits))  # fmt: skip
    assert layer(x[:0], logits[:0]).shape == (0, H)
    assert layer(x.reshape(3, 4, H)[:, :0], logits.reshape(3, 4, E)[:, :0]).shape == (3, 0, H)
    with pytest.raises(ValueError, match=r"router_logits must have the leading dims of x \[3, 4\], got shape \[4, 3, "):
        layer(x.reshape(3, 4, H), logits.reshape(4, 3, E))
    with pytest.raises(ValueError, match=r"topk_ids must have the leading dims of x \[2, 6\], got shape \[12, "):
        layer.forward_routed(x.reshape(2, 6, H), ids, w.reshape(2, 6, -1))


def test_load_state_dict_refuses_other_dtypes() -> None:
    """copy_ would convert bf16 weights into FP8 codes (or scales into bf16 and back) silently."""
    g = torch.Generator().manual_seed(4)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K)
    sd = layer.state_dict()
    for key, dtype in (("w13", torch.bfloat16), ("w2_scale", torch.bfloat16)):
        bad = dict(sd, **{key: sd[key].to(dtype)})
        with pytest.raises(TypeError, match=rf"FusedMoE: state_dict\['{key}'\] must be torch\.float"):
            layer.load_state_dict(bad)
    layer.load_state_dict(sd)


def test_load_state_dict_checks_values_as_the_constructors_do() -> None:
    """The documented meta -> to_empty -> load_state_dict route gets from_fp8's checks: a NaN or
    non-positive block scale gives NaN or undequantized rows, a NaN or +inf bias one expert for every
    token, and the ops on the GPU cannot check either without a host sync per call."""
    g = torch.Generator().manual_seed(5)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K)
    sd = layer.state_dict()
    for key, fill in (("w13_scale", float("nan")), ("w2_scale", 0.0), ("w2_scale", -1.0)):
        bad = dict(sd, **{key: sd[key].clone().index_fill_(0, torch.tensor([1]), fill)})
        with pytest.raises(ValueError, match=rf"FusedMoE: state_dict\['{key}'\] must be finite and > 0"):
            layer.load_state_dict(bad)
    biased = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K, routing_method="deepseek_v3",
                                score_bias=torch.zeros(E))  # fmt: skip
    sd = biased.state_dict()
    for fill, shown in ((float("inf"), "inf"), (float("nan"), "nan")):
        bad = dict(sd, score_bias=torch.zeros(E).index_fill_(0, torch.tensor([2]), fill))
        msg = rf"FusedMoE: state_dict\['score_bias'\] must not be NaN or \+inf, got {shown} at expert 2"
        with pytest.raises(ValueError, match=msg):
            biased.load_state_dict(bad)
    biased.load_state_dict(sd)


# ----------------------------------------------------------------------------- from_hf_fp8


def test_weights_never_materialised_raise() -> None:
    """A layer built on ``meta`` and called on real inputs raises (the ops' fake kernel, which the
    dispatcher picks when one argument is on meta, would otherwise return empty memory)."""
    m = FusedMoE(8, 2, 256, 128, device="meta")
    x, logits = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"cute_moe\.fused_moe: all tensors must be on one device: x is on cpu, w13 is on meta"):
        m(x, logits)
    y = torch.empty(8, 256, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"cute_moe\.finalize: all tensors must be on one device: y is on meta, topk_weights is on cpu"):
        cute_moe.finalize(y, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32))
    ids, w = cute_moe.route(torch.randn(3, 8, device="meta"), 2, "softmax")  # all on meta: shapes only
    assert ids.is_meta and ids.shape == (3, 2)


def test_from_hf_fp8_state_dict_round_trip() -> None:
    g = torch.Generator().manual_seed(4)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, score_bias=torch.randn(E, generator=g) * 0.1, **DSV3)
    sd = _hf_state_dict(layer)
    loaded = FusedMoE.from_hf_fp8(sd, PREFIX.rstrip("."), E, TOP_K, **DSV3)  # the trailing dot is added
    _assert_same_weights(layer, loaded)
    assert _equal(loaded(x, logits), layer(x, logits))
    # FlashInfer's half order from the same checkpoint
    up_first = FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, gate_first=False, **DSV3)
    assert _equal(up_first.w13[:, :I], layer.w13[:, I:]) and _equal(up_first(x, logits), layer(x, logits))
    # deepseek_v3 without the checkpoint's bias (a wrong prefix, a dropped key): loads, with a warning
    no_bias = {k: v for k, v in sd.items() if not k.endswith("e_score_correction_bias")}
    with pytest.warns(UserWarning, match=r"routing_method='deepseek_v3' and the checkpoint has none of \[.*gate\.e_sc"):
        assert FusedMoE.from_hf_fp8(no_bias, PREFIX, E, TOP_K, **DSV3).score_bias is None
    # fewer experts than the checkpoint holds: a truncated layer, refused
    with pytest.raises(ValueError, match=r"holds 'model\.layers\.3\.mlp\.experts\.4\.gate_proj\.weight': num_experts = 4"):
        FusedMoE.from_hf_fp8(no_bias, PREFIX, 4, TOP_K)


def test_from_bf16_refuses_non_finite_weights() -> None:
    g = torch.Generator().manual_seed(5)
    w13, w2 = _bf16_weights(g)
    w2[3, 7, 9] = float("inf")
    with pytest.raises(ValueError, match=r"FusedMoE\.from_bf16: w2\[3\] must be finite"):
        FusedMoE.from_bf16(w13, w2, top_k=TOP_K)
    w2[3, 7, 9] = 0.0
    w13[5, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"FusedMoE\.from_bf16: w13\[5\] must be finite"):
        FusedMoE.from_bf16(w13, w2, top_k=TOP_K)


def test_from_hf_fp8_scale_dtypes_and_bias_keys() -> None:
    """weight_scale_inv in bf16 / fp16 (Qwen3 FP8 releases) or e8m0 loads exactly as f32 (scales
    chosen to be exact in each); the routing bias is found where MiniMax-M2 (block level) and
    AFMoE / LFM2-MoE (``expert_bias``) keep it; ERNIE-4.5's softmax bias and a bias under another
    method are refused rather than ignored."""
    g = torch.Generator().manual_seed(8)
    w13, w2 = _bf16_weights(g)
    bias = torch.randn(E, generator=g) * 0.1
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, score_bias=bias, **DSV3)
    for name in ("w13_scale", "w2_scale"):  # powers of two: exact in bf16, fp16 and e8m0
        s = getattr(layer, name)
        setattr(layer, name, torch.exp2(torch.log2(s).round()))
    sd = _hf_state_dict(layer)
    x, logits = _inputs(g)
    for dt in (torch.bfloat16, torch.float16, torch.float8_e8m0fnu):
        cast = {k: v.to(dt) if k.endswith("weight_scale_inv") else v for k, v in sd.items()}
        loaded = FusedMoE.from_hf_fp8(cast, PREFIX, E, TOP_K, **DSV3)
        _assert_same_weights(layer, loaded)
        assert loaded.w13_scale.dtype == torch.float32
    nan_key = next(k for k in sd if k.endswith("weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"{re.escape(repr(nan_key))} must be finite and > 0, got nan"):
        nan_scales = torch.full_like(sd[nan_key], 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        FusedMoE.from_hf_fp8(sd | {nan_key: nan_scales}, PREFIX, E, TOP_K, **DSV3)
    gate_key = f"{PREFIX}gate.e_score_correction_bias"
    for key in ("e_score_correction_bias", "expert_bias"):
        moved = {k: v for k, v in sd.items() if k != gate_key} | {PREFIX + key: bias}
        loaded = FusedMoE.from_hf_fp8(moved, PREFIX, E, TOP_K, **DSV3)
        assert _equal(loaded.score_bias, bias) and _equal(loaded(x, logits), layer(x, logits))
        ignored = r"\(a sigmoid routing's selection bias\), which routing_method='sigmoid_renorm' would ignore"
        with pytest.raises(ValueError, match=rf"has '{re.escape(PREFIX + key)}' " + ignored):
            FusedMoE.from_hf_fp8(moved, PREFIX, E, TOP_K, routing_method="sigmoid_renorm")
    with pytest.raises(ValueError, match=r"more than one routing bias"):
        FusedMoE.from_hf_fp8(sd | {f"{PREFIX}expert_bias": bias}, PREFIX, E, TOP_K, **DSV3)
    ernie = sd | {f"{PREFIX}moe_statics.e_score_correction_bias": bias[None]}
    with pytest.raises(ValueError, match=r"ERNIE-4\.5's selection bias on softmax scores"):
        FusedMoE.from_hf_fp8(ernie, PREFIX, E, TOP_K, routing_method="renormalize")


def _write_two_shards(sd: dict, folder) -> dict:
    """``sd`` as two safetensors shards in ``folder`` and the index HF writes beside them; the index's
    weight_map."""
    from safetensors.torch import save_file

    keys = sorted(sd)
    weight_map = {}
    for n, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{n + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_from_hf_fp8_safetensors_file_and_sharded_directory(tmp_path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(5)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g)
    layer = FusedMoE.from_bf16(w13, w2, top_k=TOP_K, score_bias=torch.randn(E, generator=g) * 0.1, **DSV3)
    sd = _hf_state_dict(layer)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(sd, str(path))
    for ckpt in (path, str(path), [str(path)]):
        loaded = FusedMoE.from_hf_fp8(ckpt, PREFIX, E, TOP_K, **DSV3)
        _assert_same_weights(layer, loaded)
    assert _equal(loaded(x, logits), layer(x, logits))
    # a sharded checkpoint: two files and the index HF writes beside them
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    _write_two_shards(sd, shard_dir)
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(shard_dir, PREFIX, E, TOP_K, **DSV3))
    (shard_dir / "model.safetensors.index.json").unlink()  # no index: every *.safetensors in the directory
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(shard_dir, PREFIX, E, TOP_K, **DSV3))


def test_from_hf_fp8_index_path_missing_shard_and_duplicate_keys(tmp_path) -> None:
    """The index file itself names its directory's shards; an index naming a shard that is not
    there, and a key held by two files of a directory without an index (a stale shard), are refused."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    q13, s13, q2, s2 = _good_weights()
    layer = FusedMoE.from_fp8(q13, s13, q2, s2, top_k=TOP_K)
    sd = _hf_state_dict(layer)
    weight_map = _write_two_shards(sd, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(index, PREFIX, E, TOP_K))
    index.write_text(json.dumps({"weight_map": {**weight_map, "x": "model-00003-of-00003.safetensors"}}))
    with pytest.raises(ValueError, match=r"FusedMoE\.from_hf_fp8: checkpoint index .* names shards that do not exist"):
        FusedMoE.from_hf_fp8(tmp_path, PREFIX, E, TOP_K)
    # a stale shard holding a tensor again: the index says which file is current; without an index
    # only a tensor the loader reads is refused
    k_gate, k_norm = f"{PREFIX}experts.0.gate_proj.weight", "model.layers.3.input_layernorm.weight"
    safetensors_torch.save_file({k_gate: (sd[k_gate].float() / 2).to(FP8), k_norm: sd[k_norm]}, str(tmp_path / "old.safetensors"))
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(tmp_path, PREFIX, E, TOP_K))
    index.unlink()
    with pytest.raises(ValueError, match=rf"'{re.escape(k_gate)}' is in more than one file"):
        FusedMoE.from_hf_fp8(tmp_path, PREFIX, E, TOP_K)
    safetensors_torch.save_file({k_norm: sd[k_norm]}, str(tmp_path / "old.safetensors"))
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(tmp_path, PREFIX, E, TOP_K))


def test_from_hf_fp8_names_a_missing_or_unreadable_file(tmp_path) -> None:
    """A list naming a file that is not there, or one that is not safetensors: the file's path in
    the message, not safetensors' bare error."""
    pytest.importorskip("safetensors")
    missing, corrupt = tmp_path / "missing.safetensors", tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    gone = rf"FusedMoE\.from_hf_fp8: checkpoint file '{re.escape(str(missing))}' does not exist"
    with pytest.raises(FileNotFoundError, match=gone):
        FusedMoE.from_hf_fp8([str(missing)], PREFIX, E, TOP_K)
    unreadable = rf"checkpoint file '{re.escape(str(corrupt))}' is not a readable \.safetensors file"
    with pytest.raises(ValueError, match=unreadable):
        FusedMoE.from_hf_fp8(corrupt, PREFIX, E, TOP_K)


def test_minus_inf_score_bias_masks_an_expert() -> None:
    """-inf in the selection bias (an expert never chosen) is allowed, as the op allows it."""
    bias = torch.zeros(E)
    bias[3] = float("-inf")
    layer = FusedMoE.from_fp8(*_good_weights(), top_k=TOP_K, score_bias=bias, **DSV3)
    ids, w = layer.route(torch.randn(64, E))
    assert not bool((ids == 3).any()) and bool(torch.isfinite(w).all())


def test_route_refuses_logits_of_another_width() -> None:
    layer = FusedMoE.from_fp8(*_good_weights(), top_k=TOP_K)
    for width in (E - 1, E + 1):
        with pytest.raises(ValueError, match=rf"FusedMoE\.route: router_logits must be \[T, num_experts = {E}\], got"):
            layer.route(torch.randn(5, width))


def test_from_hf_fp8_mixtral_names() -> None:
    g = torch.Generator().manual_seed(6)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K)
    prefix = "model.layers.0.block_sparse_moe."
    sd = _hf_state_dict(layer, prefix, names=("w1", "w3", "w2"))
    _assert_same_weights(layer, FusedMoE.from_hf_fp8(sd, prefix, E, TOP_K, proj_names=("w1", "w3", "w2")))


# ----------------------------------------------------------------------------- expert parallelism


def _shards(sd: dict, num_shards: int, top_k: int, **kw: Any) -> list[FusedMoE]:
    """One layer per rank, each loaded from a state dict holding only its own experts' tensors."""
    per = E // num_shards
    out = []
    for r in range(num_shards):
        mine = {k: v for k, v in sd.items()
                if not (m := re.search(r"experts\.(\d+)\.", k)) or r * per <= int(m.group(1)) < (r + 1) * per}  # fmt: skip
        out.append(FusedMoE.from_hf_fp8(mine, PREFIX, E, top_k, expert_offset=r * per, num_local_experts=per, **kw))
    return out


@pytest.mark.parametrize("num_shards", [2, 4])
def test_expert_parallel_shards_sum_to_the_whole_layer(num_shards: int) -> None:
    """Each rank's y rows are bit-identical to the whole layer's (same per-token activation scales, same
    GEMM rows), so the ranks' outputs differ from the whole only in finalize's bf16 rounding: every
    rank rounds its f32 partial sum p_r once (|o_r - p_r| <= 2^-8 |p_r|, bf16's unit roundoff) and the
    whole layer rounds sum_r p_r once, so |sum_r o_r - whole| <= 2^-7 * sum_r |p_r| (+ slack)."""
    g = torch.Generator().manual_seed(7)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g, t=32)
    whole = FusedMoE.from_bf16(w13, w2, top_k=4, score_bias=torch.randn(E, generator=g) * 0.1, **DSV3)
    sd = _hf_state_dict(whole)
    shards = _shards(sd, num_shards, top_k=4, **DSV3)
    per = E // num_shards
    for r, s in enumerate(shards):
        assert s.num_local_experts == per and s.expert_offset == r * per and s.w13.shape[0] == per
        assert _equal(s.w13, whole.w13[r * per : (r + 1) * per]) and _equal(s.w2_scale, whole.w2_scale[r * per : (r + 1) * per])
        # from_bf16 with the global weights takes the same slice
        _assert_same_weights(s, FusedMoE.from_bf16(w13, w2, top_k=4, score_bias=whole.score_bias,
                                                   expert_offset=r * per, num_local_experts=per, **DSV3))  # fmt: skip
    outs = torch.stack([s(x, logits).float() for s in shards])
    want = whole(x, logits).float()
    bound = 2.0**-7 * outs.abs().sum(0) * 1.01 + 1e-6
    assert bool(((outs.sum(0) - want).abs() <= bound).all())
    assert ((outs.sum(0) - want).norm() / want.norm()).item() < 1e-2


def test_expert_parallel_top1_is_exact() -> None:
    """With top-1 routing exactly one rank holds each token's expert: the sum of the ranks is bit-exact."""
    g = torch.Generator().manual_seed(8)
    w13, w2 = _bf16_weights(g)
    x, logits = _inputs(g, t=32)
    whole = FusedMoE.from_bf16(w13, w2, top_k=1, routing_method="softmax")
    shards = [FusedMoE.from_bf16(w13, w2, top_k=1, routing_method="softmax", expert_offset=o, num_local_experts=2)
              for o in range(0, E, 2)]  # fmt: skip
    total = shards[0](x, logits)
    for s in shards[1:]:
        total = total + s(x, logits)
    assert _equal(total, whole(x, logits))
    ids, w = whole.route(logits)
    assert _equal(sum(s.forward_routed(x, ids, w) for s in shards[1:]) + shards[0].forward_routed(x, ids, w),
                  whole.forward_routed(x, ids, w))  # fmt: skip


# ----------------------------------------------------------------------------- module plumbing


def test_state_dict_meta_init_and_dtype_casts() -> None:
    g = torch.Generator().manual_seed(9)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K, score_bias=torch.randn(E, generator=g), **DSV3)
    x, logits = _inputs(g)
    want = layer(x, logits)
    assert set(layer.state_dict()) == {"w13", "w13_scale", "w2", "w2_scale", "score_bias"}
    fresh = FusedMoE(E, TOP_K, H, I, has_score_bias=True, device="meta", **DSV3)
    assert fresh.w13.device.type == "meta" and fresh.w13.dtype == FP8
    fresh = fresh.to_empty(device="cpu")
    fresh.load_state_dict(layer.state_dict())
    assert _equal(fresh(x, logits), want)
    # dtype casts (what model.to(torch.bfloat16) does) keep the FP8 codes and f32 scales and bias
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("cpu")):
        cast(fresh)
        assert fresh.w13.dtype == FP8 and fresh.w2.dtype == FP8
        assert fresh.w13_scale.dtype == torch.float32 and fresh.score_bias.dtype == torch.float32
        assert _equal(fresh(x, logits), want)
    wrapper = nn.Sequential(fresh).to(torch.bfloat16)
    assert wrapper[0].w13.dtype == FP8
    assert "deepseek_v3" in repr(fresh) and "n_group=4" in repr(fresh)
    zero = FusedMoE(E, TOP_K, H, I)
    assert not zero.w13.view(torch.uint8).any() and zero.score_bias is None


def test_import_does_not_load_optional_packages() -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch, cute_moe\n"
        "assert cute_moe.FusedMoE.__module__ == 'cute_moe.layer'\n"
        "for m in ('cutlass', 'safetensors', 'transformers'):\n"
        "    assert m not in sys.modules, m + ' imported'\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- validation


def _good_weights() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10)
    q13, s13 = R.quant_block_128x128_ref(torch.randn(E, 2 * I, H, generator=g) * 0.05)
    q2, s2 = R.quant_block_128x128_ref(torch.randn(E, H, I, generator=g) * 0.05)
    return q13, s13, q2, s2


class _ScaleParameter(nn.Parameter):
    """A Parameter subclass, as vLLM's weight parameters are."""


def nan_at(t: torch.Tensor, i: int) -> torch.Tensor:
    t.view(-1)[i] = float("nan")
    return t


def _bad_calls() -> list[tuple[str, Callable[[], Any], type[Exception], str]]:
    q13, s13, q2, s2 = _good_weights()
    w13, w2 = q13.float(), q2.float()
    sd = _hf_state_dict(FusedMoE.from_fp8(q13, s13, q2, s2, top_k=TOP_K))
    ctor = lambda **kw: FusedMoE(**{"num_experts": E, "top_k": TOP_K, "hidden_size": H, "intermediate_size": I, **kw})  # noqa: E731

    def without(key: str) -> dict:
        return {k: v for k, v in sd.items() if k != key}

    def replaced(key: str, v: torch.Tensor) -> dict:
        return {**sd, key: v}

    k_up = f"{PREFIX}experts.1.up_proj.weight"
    k_down_s = f"{PREFIX}experts.2.down_proj.weight_scale_inv"
    return [
        ("top_k > E", lambda: ctor(top_k=9), ValueError, r"top_k must be <= num_experts = 8"),
        ("top_k type", lambda: ctor(top_k=2.0), TypeError, r"top_k must be an int"),
        ("H % 128", lambda: ctor(hidden_size=200), ValueError, r"hidden_size must be a multiple of 128"),
        ("I % 128", lambda: ctor(intermediate_size=96), ValueError, r"intermediate_size must be a multiple of 128"),
        ("method", lambda: ctor(routing_method="topk"), ValueError, r"routing_method must be one of"),
        ("groups w/o dsv3", lambda: ctor(n_group=2), ValueError, r"n_group and topk_group must be 1"),
        ("E % n_group", lambda: ctor(routing_method="deepseek_v3", n_group=3), ValueError, r"divisible by n_group"),
        ("topk_group", lambda: ctor(routing_method="deepseek_v3", n_group=4, topk_group=5), ValueError,
         r"topk_group must be <= n_group"),
        ("top_k vs groups", lambda: ctor(routing_method="deepseek_v3", n_group=4, topk_group=1, top_k=3), ValueError,
         r"top_k must be <= topk_group \* \(num_experts / n_group\) = 2"),
        ("bias w/o dsv3", lambda: ctor(has_score_bias=True), ValueError, r"score_bias is only allowed"),
        ("EP range", lambda: ctor(expert_offset=6, num_local_experts=4), ValueError,
         r"expert_offset \+ num_local_experts must be <= num_experts = 8, got 6 \+ 4"),
        ("offset < 0", lambda: ctor(expert_offset=-1), ValueError, r"expert_offset must be >= 0"),
        ("offset = E", lambda: ctor(expert_offset=8), ValueError, r"expert_offset must be <= num_experts - 1 = 7, got 8"),
        ("gate_first", lambda: ctor(gate_first=1), TypeError, r"gate_first must be a bool"),
        ("act fmt", lambda: ctor(act_scale_fmt="e8m0"), ValueError, r"act_scale_fmt must be one of None, 'ue8m0'"),
        ("device name", lambda: ctor(device="gpu0"), ValueError, r"device is not a device: 'gpu0'"),
        ("device type", lambda: ctor(device=1.0), TypeError, r"device must be None, a torch.device, a str or an int"),
        ("bf16 device", lambda: FusedMoE.from_bf16(w13, w2, top_k=2, device="nope"), ValueError,
         r"device is not a device: 'nope'"),
        ("hf device", lambda: FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, device="nope"), ValueError,
         r"device is not a device: 'nope'"),
        ("E > int32", lambda: ctor(num_experts=2**63), ValueError, r"num_experts must be <= 2147483647"),
        ("H > int32", lambda: ctor(hidden_size=2**63), ValueError, r"hidden_size must be <= 2147483647"),
        ("meta bias", lambda: FusedMoE.from_fp8(q13, s13, q2, s2, top_k=2, score_bias=torch.zeros(E, device="meta"),
                                                **DSV3), ValueError, r"score_bias is a meta tensor"),
        ("bf16 to meta", lambda: FusedMoE.from_bf16(w13, w2, top_k=2, device="meta"), ValueError,
         r"device is meta: from_bf16 quantizes"),
        ("bf16 meta weight", lambda: FusedMoE.from_bf16(w13, w2.to("meta"), top_k=2), ValueError,
         r"w2\[0\] is a meta tensor: it has no data to quantize"),
        ("hf meta weight", lambda: FusedMoE.from_hf_fp8(replaced(k_up, sd[k_up].to("meta")), PREFIX, E, TOP_K),
         ValueError, rf"'{re.escape(k_up)}' is a meta tensor: it has no data to load"),
        ("hf to meta", lambda: FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, device="meta"), ValueError,
         r"device is meta: from_hf_fp8 loads the checkpoint's data"),
        ("hf meta scale", lambda: FusedMoE.from_hf_fp8(replaced(k_down_s, sd[k_down_s].to("meta")), PREFIX, E, TOP_K),
         ValueError, rf"'{re.escape(k_down_s)}' is a meta tensor"),
        ("weight on input type", lambda: ctor(top_k=1, apply_router_weight_on_input=1), TypeError,
         r"apply_router_weight_on_input must be a bool, got int"),
        ("hf weight on input type",
         lambda: FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, apply_router_weight_on_input="yes"), TypeError,
         r"apply_router_weight_on_input must be a bool, got str"),
        # from_fp8
        ("fp8 dtype", lambda: FusedMoE.from_fp8(q13.float(), s13, q2, s2, top_k=2), TypeError,
         r"w13 must be float8_e4m3fn, got torch.float32"),
        ("scale shape", lambda: FusedMoE.from_fp8(q13, s13[:, :1], q2, s2, top_k=2), ValueError,
         r"w13_scale must have shape \[E_local, 2I/128, H/128\] = \[8, 2, 2\], got \[8, 1, 2\]"),
        ("scale dtype", lambda: FusedMoE.from_fp8(q13, s13, q2, s2.bfloat16(), top_k=2), TypeError,
         r"w2_scale must be float32"),
        ("w2 shape", lambda: FusedMoE.from_fp8(q13, s13, q2[:4], s2, top_k=2), ValueError,
         r"w2 must have shape \[E_local, H, I\] = \[8, 256, 128\], got \[4, 256, 128\]"),
        ("w13 2I", lambda: FusedMoE.from_fp8(q13[:, :64], s13, q2, s2, top_k=2), ValueError,
         r"w13 must be \[E_local, 2I, H\] with I and H multiples of 128"),
        ("no experts", lambda: FusedMoE.from_fp8(q13[:0], s13[:0], q2[:0], s2[:0], top_k=2), ValueError,
         r"w13 must have E_local, 2I and H >= 1, got shape \[0, 256, 256\]"),
        ("I = 0", lambda: FusedMoE.from_fp8(q13[:, :0], s13[:, :0], q2[:, :, :0], s2[:, :, :0], top_k=2), ValueError,
         r"w13 must have E_local, 2I and H >= 1, got shape \[8, 0, 256\]"),
        ("bias shape", lambda: FusedMoE.from_fp8(q13, s13, q2, s2, top_k=2, score_bias=torch.zeros(4), **DSV3),
         ValueError, r"score_bias must have shape \[num_experts\] = \[8\]"),
        # from_bf16
        ("bf16 E mismatch", lambda: FusedMoE.from_bf16(w13, w2[:4], top_k=2), ValueError, r"w2 must hold 8 experts"),
        ("bf16 dtype", lambda: FusedMoE.from_bf16(w13.to(FP8), w2, top_k=2), TypeError,
         r"w13\[:, :I\]\[0\] must be one of bfloat16, float16, float32, got torch.float8_e4m3fn"),
        ("bf16 I % 128", lambda: FusedMoE.from_bf16(w13[:, :192], w2, top_k=2), ValueError,
         r"intermediate_size must be a multiple of 128 .*, got 96"),
        ("bf16 slice", lambda: FusedMoE.from_bf16(w13[:6], w2[:6], num_experts=8, top_k=2, expert_offset=4), ValueError,
         r"must hold num_experts = 8 experts or num_local_experts = 4, got 6"),
        ("bf16 form", lambda: FusedMoE.from_bf16("w", w2, top_k=2), TypeError, r"w13 must be a tensor"),
        ("bf16 down shape", lambda: FusedMoE.from_bf16(w13, w2.transpose(1, 2), top_k=2), ValueError,
         r"w2\[0\] must have shape \[H, I\] = \[256, 128\], got \[128, 256\]"),
        # from_hf_fp8
        ("missing key", lambda: FusedMoE.from_hf_fp8(without(k_up), PREFIX, E, TOP_K), ValueError,
         rf"is missing '{re.escape(k_up)}' \(expert 1's up_proj weight\)"),
        ("missing scale", lambda: FusedMoE.from_hf_fp8(without(k_down_s), PREFIX, E, TOP_K), ValueError,
         rf"is missing '{re.escape(k_down_s)}'"),
        ("wrong prefix", lambda: FusedMoE.from_hf_fp8(sd, "model.layers.4.mlp.", E, TOP_K), ValueError,
         r"is missing 'model\.layers\.4\.mlp\.experts\.0\.gate_proj\.weight'"),
        ("hf dtype", lambda: FusedMoE.from_hf_fp8(replaced(k_up, sd[k_up].bfloat16()), PREFIX, E, TOP_K), TypeError,
         rf"'{re.escape(k_up)}' must be float8_e4m3fn, got torch.bfloat16"),
        ("hf shape", lambda: FusedMoE.from_hf_fp8(replaced(k_up, sd[k_up][:64]), PREFIX, E, TOP_K), ValueError,
         rf"'{re.escape(k_up)}' must have shape \[I, H\] = \[128, 256\], got \[64, 256\]"),
        ("hf scale shape", lambda: FusedMoE.from_hf_fp8(replaced(k_down_s, sd[k_down_s].t()), PREFIX, E, TOP_K),
         ValueError, r"must have shape \[ceil\(H/128\), ceil\(I/128\)\] = \[2, 1\], got \[1, 2\]"),
        ("hf I % 128", lambda: FusedMoE.from_hf_fp8(
            replaced(f"{PREFIX}experts.0.gate_proj.weight", torch.zeros(96, H, dtype=FP8)), PREFIX, E, TOP_K),
         ValueError, r"I must be a multiple of 128"),
        ("hf bias w/o dsv3", lambda: FusedMoE.from_hf_fp8(
            {**sd, f"{PREFIX}gate.e_score_correction_bias": torch.zeros(E)}, PREFIX, E, TOP_K),
         ValueError, r"e_score_correction_bias.*use routing_method='deepseek_v3'"),
        ("hf checkpoint type", lambda: FusedMoE.from_hf_fp8(42, PREFIX, E, TOP_K), TypeError,
         r"checkpoint must be a state dict"),
        ("hf no file", lambda: FusedMoE.from_hf_fp8("/nonexistent/x.safetensors", PREFIX, E, TOP_K), ValueError,
         r"is neither a file nor a directory"),
        ("hf prefix type", lambda: FusedMoE.from_hf_fp8(sd, 3, E, TOP_K), TypeError, r"prefix must be a str"),
        ("hf EP range", lambda: FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, expert_offset=8), ValueError,
         r"expert_offset must be <= num_experts - 1 = 7, got 8"),
        # values that would give wrong or NaN outputs
        ("bias NaN", lambda: FusedMoE.from_fp8(q13, s13, q2, s2, top_k=2, score_bias=nan_at(torch.zeros(E), 1), **DSV3),
         ValueError, r"score_bias must not be NaN or \+inf, got nan at expert 1"),
        ("hf bias NaN", lambda: FusedMoE.from_hf_fp8(
            {**sd, f"{PREFIX}gate.e_score_correction_bias": nan_at(torch.zeros(E), 5)}, PREFIX, E, TOP_K, **DSV3),
         ValueError,
         r"'model\.layers\.3\.mlp\.gate\.e_score_correction_bias' must not be NaN or \+inf, got nan at expert 5"),
        ("scale NaN", lambda: FusedMoE.from_fp8(q13, nan_at(s13.clone(), 0), q2, s2, top_k=2), ValueError,
         r"w13_scale must be finite and > 0, got nan"),
        ("scale NaN, Parameter subclass", lambda: FusedMoE.from_fp8(
            q13, _ScaleParameter(nan_at(s13.clone(), 3), requires_grad=False), q2, s2, top_k=2), ValueError,
         r"w13_scale must be finite and > 0, got nan"),
        ("hf scale zero", lambda: FusedMoE.from_hf_fp8(replaced(k_down_s, sd[k_down_s] * 0), PREFIX, E, TOP_K),
         ValueError, rf"'{re.escape(k_down_s)}' must be finite and > 0, got 0\.0"),
        ("scale zero", lambda: FusedMoE.from_fp8(q13, s13, q2, s2 * 0, top_k=2), ValueError,
         r"w2_scale must be finite and > 0, got 0\.0"),
        ("hf proj names", lambda: FusedMoE.from_hf_fp8(sd, PREFIX, E, TOP_K, proj_names=("gate_proj", "gate_proj",
                                                                                        "down_proj")),
         ValueError, r"proj_names must be three distinct names \(gate, up, down\)"),
    ]  # fmt: skip


_BAD = _bad_calls()


@pytest.mark.parametrize("case", range(len(_BAD)), ids=[c[0] for c in _BAD])
def test_validation_errors(case: int) -> None:
    _, call, exc, pattern = _BAD[case]
    with pytest.raises(exc, match=r"cute_moe\.FusedMoE[.\w]*: .*" + pattern):
        call()


def test_forward_errors_name_the_argument() -> None:
    q13, s13, q2, s2 = _good_weights()
    layer = FusedMoE.from_fp8(q13, s13, q2, s2, top_k=TOP_K)
    x = torch.randn(4, H).bfloat16()
    with pytest.raises(ValueError, match=r"cute_moe.FusedMoE: router_logits must be \[..., num_experts = 8\], got "
                                         r"shape \[4, 16\]"):  # fmt: skip
        layer(x, torch.randn(4, 16))
    with pytest.raises(TypeError, match=r"cute_moe.fused_moe: x must be one of bfloat16, float16, got torch.float32"):
        layer(x.float(), torch.randn(4, E))
    with pytest.raises(ValueError, match=r"cute_moe.FusedMoE: router_logits must have the leading dims of x \[4\]"):
        layer(x, torch.randn(5, E))
    with pytest.raises(ValueError, match=r"cute_moe.FusedMoE: x must be \[..., H\] with at least 2 dims"):
        layer(x[0], torch.randn(E))
    with pytest.raises(ValueError, match=r"cute_moe.FusedMoE: router_logits must be \[..., num_experts\]"):
        layer(x, torch.randn(E))
    with pytest.raises(TypeError, match=r"cute_moe.FusedMoE: topk_ids must be a torch.Tensor"):
        layer.forward_routed(x, [[0, 1]] * 4, torch.rand(4, 2))


# ----------------------------------------------------------------------------- torch.compile


class _Block(nn.Module):
    """A model around the layer: f32 router, routed experts, a residual."""

    def __init__(self, layer: FusedMoE, g: torch.Generator) -> None:
        super().__init__()
        self.router = nn.Linear(H, layer.num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(layer.num_experts, H, generator=g) * H**-0.5)
        self.moe = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x.float())
        return x + self.moe(x, logits)


def test_torch_compile_fullgraph_dynamic() -> None:
    g = torch.Generator().manual_seed(11)
    layer = FusedMoE.from_bf16(*_bf16_weights(g), top_k=TOP_K, score_bias=torch.randn(E, generator=g) * 0.1, **DSV3)
    model = _Block(layer, g).eval()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
            compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
            for t in (3, 9, 17):
                x = torch.randn(2, t, H, generator=g).bfloat16()
                assert _equal(compiled(x), model(x))
        assert len([gr for gr in counter.graphs if "cute_moe" in gr.code]) == 1
    finally:
        torch._dynamo.reset()


def test_exported_from_package() -> None:
    assert cute_moe.FusedMoE is FusedMoE and "FusedMoE" in cute_moe.__all__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch has no CUDA device")
def test_cuda_device_without_cuda_is_named() -> None:
    with pytest.raises(ValueError, match=r"cute_moe\.FusedMoE: device is 'cuda', but this torch has no CUDA device"):
        FusedMoE(E, TOP_K, H, I, device="cuda")
