"""``FusedMoE``: a whole FP8 MoE layer as a ``torch.nn.Module``.

The module holds the routed experts' FP8 weights and their 128x128 f32 block scales
as buffers, in the layout of the README's "Layouts" section, and its ``forward`` is one call of
:func:`cute_moe.functional.fused_moe` (route -> align -> permute_quant -> GEMM with SwiGLU
re-quant -> GEMM -> finalize), so it traces under
``torch.compile(fullgraph=True)`` and runs wherever the ops run (the CPU reference
on a machine without a GPU).

========== =============================== =========== ===================================
buffer     shape                           dtype       notes
========== =============================== =========== ===================================
w13        [E_local, 2I, H]                e4m3fn      gate rows [0, I), up rows [I, 2I)
                                                       when ``gate_first`` (else up first)
w13_scale  [E_local, 2I/128, H/128]        float32     = HF ``weight_scale_inv`` per expert
w2         [E_local, H, I]                 e4m3fn
w2_scale   [E_local, H/128, I/128]         float32
score_bias [E] (global) or None            float32     ``deepseek_v3`` correction bias
========== =============================== =========== ===================================

``H`` and ``I`` must be multiples of 128 (the 1x128 activation groups of both GEMMs),
so every weight scale tensor has exactly ``N/128`` rows.

**The router is not part of the module.** ``forward(x, router_logits)`` takes the
logits ``[T, E]`` over the *global* experts: the router GEMM is a plain linear layer
whose dtype the model chooses (DeepSeek-V3 keeps ``gate.weight`` in f32, Mixtral and
Qwen3 run it in the activation dtype), and under expert parallelism every rank
needs the logits of every expert. ``from_hf_fp8`` therefore does not read
``{prefix}gate.weight``; it does read a sigmoid routing's selection bias (the
``deepseek_v3`` ``score_bias``) where the checkpoint keeps one (see ``from_hf_fp8``).
``route(router_logits)`` returns the top-k ``forward`` uses. Routing done elsewhere (a different router, or top-k ids
shipped from another rank) goes through ``forward_routed(x, topk_ids, topk_weights)``.

**Expert parallelism.** A module owns the experts
``[expert_offset, expert_offset + num_local_experts)`` of ``num_experts``; token
slots routed to other experts contribute nothing, so the layer's output is the sum
of every rank's output (an all-reduce). Shared experts (DeepSeek-V3, Qwen2-MoE) are
not part of the module: add their output to ``forward``'s.

Numerics: activations are quantized to FP8 e4m3 with one f32 scale per token per
128 columns (both before GEMM1 and after SwiGLU), f32 accumulation, bf16 GEMM outputs;
the layer's output is bf16, or fp16 for fp16 hidden states.

Dtype conversions of the module (``.to(torch.bfloat16)``, ``.half()``, ...) leave the
FP8 weights and the f32 scales and bias as they are; device moves apply.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from cute_moe import functional as Fn
from cute_moe import reference as R
from cute_moe import validation as V

__all__ = ["FusedMoE"]

_B = V.ACT_GROUP_SIZE  # 128: activation group, weight block edge
_FP8 = V.FP8_DTYPE
_FLOAT_W = (torch.bfloat16, torch.float16, torch.float32)
_fail = V._fail  # cute_moe.<where>: <message>
_cdiv = V._cdiv
_HF_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")  # DeepSeek-V3 / Qwen3-MoE; Mixtral: ("w1", "w3", "w2")
# HF FP8 checkpoints store weight_scale_inv as f32, bf16 or fp16 (Qwen3 FP8 releases), or e8m0: all exact in f32
_HF_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)
# Where checkpoints keep a sigmoid routing's selection bias (deepseek_v3's score_bias), by model family
_HF_SCORE_BIAS_KEYS = (
    "gate.e_score_correction_bias",  # DeepSeek-V3/R1, Kimi-K2, GLM-4.5
    "e_score_correction_bias",  # MiniMax-M2
    "expert_bias",  # AFMoE, LFM2-MoE
)
# A selection bias on softmax scores (ERNIE-4.5): no routing method computes that
_HF_SOFTMAX_BIAS_KEY = "moe_statics.e_score_correction_bias"

Checkpoint = Union[Mapping[str, Tensor], str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]


def _check_config(
    where: str,
    num_experts: Any,
    top_k: Any,
    hidden_size: Any,
    intermediate_size: Any,
    routing_method: Any,
    n_group: Any,
    topk_group: Any,
    routed_scaling_factor: Any,
    has_score_bias: bool,
    expert_offset: Any,
    num_local_experts: Any,
    gate_first: Any,
    act_scale_fmt: Any,
    apply_router_weight_on_input: Any,
) -> int:
    """Every rule of the layer's configuration, before anything is allocated. Returns E_local."""
    V.check_int(where, "num_experts", num_experts, min=1, max=V.INT32_MAX)  # (the kernels index in int32)
    V.check_routing_config(
        where, num_experts, top_k, routing_method, n_group, topk_group, routed_scaling_factor, has_score_bias,
        "routing_method",
    )  # fmt: skip
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        V.check_int(where, name, v, min=1, max=V.INT32_MAX)
        if v % _B:
            _fail(where, f"{name} must be a multiple of {_B} (the 1x128 FP8 activation groups), got {v}")
    V.check_int(where, "expert_offset", expert_offset, min=0, max=num_experts - 1, max_what="num_experts - 1")
    if num_local_experts is None:
        num_local_experts = num_experts - expert_offset
    V.check_int(where, "num_local_experts", num_local_experts, min=1)
    if expert_offset + num_local_experts > num_experts:
        _fail(
            where,
            f"expert_offset + num_local_experts must be <= num_experts = {num_experts}, "
            f"got {expert_offset} + {num_local_experts}",
        )
    V.check_bool(where, "gate_first", gate_first)
    V.check_scale_fmt(where, "act_scale_fmt", act_scale_fmt)
    V.weight_on_input(where, apply_router_weight_on_input, routing_method)
    return int(num_local_experts)


def _check_tensor(
    where: str, name: str, t: Any, dtypes: Sequence[torch.dtype], shape: Sequence[int], what: str
) -> None:
    V.check_tensor(where, name, t)
    V.check_dtype(where, name, t, dtypes)
    V.check_shape(where, name, t, shape, what)


def _flat(t: Any, name: str, last: str, lead: Optional[tuple[Any, ...]] = None) -> tuple[Tensor, tuple[Any, ...]]:
    """``t`` [..., last] as 2-D [tokens, last], and its leading dims (which must equal ``lead``,
    those of ``x``, when given)."""
    if not isinstance(t, Tensor):
        _fail("FusedMoE", f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dim() < 2:
        _fail("FusedMoE", f"{name} must be [..., {last}] with at least 2 dims (tokens, {last}), got {list(t.shape)}")
    if lead is not None and tuple(t.shape[:-1]) != lead:
        _fail("FusedMoE", f"{name} must have the leading dims of x {list(lead)}, got shape {list(t.shape)}")
    return (t.flatten(0, -2) if t.dim() > 2 else t), tuple(t.shape[:-1])


def _check_score_bias(where: str, score_bias: Any, num_experts: int) -> Optional[Tensor]:
    if score_bias is None:
        return None
    _check_tensor(where, "score_bias", score_bias, _FLOAT_W, (num_experts,), "[num_experts]")
    V.check_bias_values(where, "score_bias", score_bias)
    return score_bias.float()


def _check_not_meta(where: str, name: str, t: Tensor, use: str) -> None:
    """ValueError for a meta tensor where the data is needed (``use``: what for); a meta layer is
    built with ``FusedMoE(..., device="meta")``."""
    if t.is_meta:
        _fail(where, f"{name} is a meta tensor: it has no data to {use}")


def _check_block_scales(where: str, name: str, scales: Tensor) -> None:
    """A NaN or infinite block scale gives NaN rows, and a zero or negative one is no dequantization;
    checked once, at construction."""
    if not V.holds_data(scales):
        return
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        _fail(where, f"{name} must be finite and > 0, got {scales[bad][0].item()}")


class FusedMoE(torch.nn.Module):
    """One FP8 MoE layer (routed experts only) over ``torch.ops.cute_moe``.

    Args:
        num_experts: global expert count ``E`` (the router's output width).
        top_k: experts per token.
        hidden_size, intermediate_size: ``H`` and ``I`` (per expert), multiples of 128.
        routing_method: ``"softmax"``, ``"renormalize"`` (softmax over the top-k logits: Mixtral,
            Qwen3-MoE with ``norm_topk_prob``), ``"deepseek_v3"``, ``"llama4"`` or ``"sigmoid_renorm"``;
            see :func:`cute_moe.route`.
        n_group, topk_group, routed_scaling_factor: grouped top-k and weight scale (see :func:`cute_moe.route`).
        has_score_bias: allocate a ``score_bias`` buffer ``[E]`` f32 (``deepseek_v3`` only).
        expert_offset, num_local_experts: this module owns experts
            ``[expert_offset, expert_offset + num_local_experts)``; ``num_local_experts`` defaults to
            ``num_experts - expert_offset``.
        gate_first: row order of ``w13`` (``True``: gate then up, the HF / DeepSeek order;
            ``False``: up then gate, as FlashInfer's CUTLASS fused-MoE weights store them).
        act_scale_fmt: scale format of the activation quantizations, ``None`` or ``"ue8m0"``.
        apply_router_weight_on_input: ``True``: each of a token's experts gets ``weight * x`` and its
            output is not weighted, HF Llama-4's convention; ``False``: the outputs are weighted.
            ``None`` (default): ``True`` for ``routing_method="llama4"``, else ``False``. See
            :func:`cute_moe.fused_moe_routed`.
        device: where the buffers are allocated (``"meta"`` allocates nothing; use ``to_empty`` then
            ``load_state_dict``). The buffers start as zeros; the ``from_*`` constructors fill them.

    Construct from weights with :meth:`from_hf_fp8` (a HuggingFace FP8 checkpoint), :meth:`from_bf16`
    (quantizes with 128x128 blocks) or :meth:`from_fp8` (already quantized tensors).
    """

    w13: Tensor
    w13_scale: Tensor
    w2: Tensor
    w2_scale: Tensor
    score_bias: Optional[Tensor]

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        routing_method: str = "renormalize",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        has_score_bias: bool = False,
        expert_offset: int = 0,
        num_local_experts: Optional[int] = None,
        gate_first: bool = True,
        act_scale_fmt: Optional[str] = None,
        apply_router_weight_on_input: Optional[bool] = None,
        device: Optional[Union[torch.device, str]] = None,
    ) -> None:
        super().__init__()
        V.check_bool("FusedMoE", "has_score_bias", has_score_bias)
        e_local = _check_config(
            "FusedMoE", num_experts, top_k, hidden_size, intermediate_size, routing_method, n_group, topk_group,
            routed_scaling_factor, has_score_bias, expert_offset, num_local_experts, gate_first, act_scale_fmt,
            apply_router_weight_on_input,
        )  # fmt: skip
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.routing_method = routing_method
        self.n_group = int(n_group)
        self.topk_group = int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.expert_offset = int(expert_offset)
        self.num_local_experts = e_local
        self.gate_first = gate_first
        self.act_scale_fmt = act_scale_fmt
        self.apply_router_weight_on_input = V.weight_on_input("FusedMoE", apply_router_weight_on_input, routing_method)
        H, I = self.hidden_size, self.intermediate_size
        device = V.as_device("FusedMoE", "device", device)
        zeros = torch.empty if device is not None and device.type == "meta" else torch.zeros
        self.register_buffer("w13", zeros(e_local, 2 * I, H, dtype=_FP8, device=device))
        self.register_buffer("w13_scale", zeros(e_local, 2 * I // _B, H // _B, dtype=torch.float32, device=device))
        self.register_buffer("w2", zeros(e_local, H, I, dtype=_FP8, device=device))
        self.register_buffer("w2_scale", zeros(e_local, H // _B, I // _B, dtype=torch.float32, device=device))
        bias = zeros(self.num_experts, dtype=torch.float32, device=device) if has_score_bias else None
        self.register_buffer("score_bias", bias)

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor, router_logits: Tensor) -> Tensor:
        """The routed experts' output for ``x``.

        Args:
            x: ``[..., H]`` bf16 or fp16 hidden states.
            router_logits: ``[..., num_experts]`` f32, bf16 or fp16 logits over the *global* experts, with the
                leading dims of ``x``.

        Returns:
            ``[..., H]`` in x's dtype: the sum over this module's experts among each token's top-k of
            ``weight * expert(x)`` (``expert(weight * x)`` with ``apply_router_weight_on_input``). Under
            expert parallelism, sum this over the ranks.
        """
        x2, lead = _flat(x, "x", "H")
        logits, _ = _flat(router_logits, "router_logits", "num_experts", lead)
        if logits.shape[1] != self.num_experts:
            _fail("FusedMoE", f"router_logits must be [..., num_experts = {self.num_experts}], got shape "
                              f"{list(router_logits.shape)}")  # fmt: skip
        out = Fn.fused_moe(
            x2,
            logits,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            self.top_k,
            self.routing_method,
            score_bias=self.score_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            expert_offset=self.expert_offset,
            num_experts=self.num_experts,
            gate_first=self.gate_first,
            act_scale_fmt=self.act_scale_fmt,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
        )
        return out.reshape(*lead, self.hidden_size)

    def forward_routed(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The routed experts' output for a top-k computed elsewhere.

        Args:
            x: ``[..., H]`` bf16 or fp16.
            topk_ids: ``[..., k]`` int32 *global* expert ids (ids this module does not own contribute nothing).
            topk_weights: ``[..., k]`` f32, bf16 or fp16, applied as given (no ``routed_scaling_factor``), to the
                expert outputs or, with ``apply_router_weight_on_input``, to the inputs.
        """
        x2, lead = _flat(x, "x", "H")
        ids, _ = _flat(topk_ids, "topk_ids", "k", lead)
        w, _ = _flat(topk_weights, "topk_weights", "k", lead)
        out = Fn.fused_moe_routed(
            x2,
            ids,
            w,
            self.w13,
            self.w13_scale,
            self.w2,
            self.w2_scale,
            expert_offset=self.expert_offset,
            gate_first=self.gate_first,
            act_scale_fmt=self.act_scale_fmt,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            num_experts=self.num_experts,
        )
        return out.reshape(*lead, self.hidden_size)

    def route(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k this layer's ``forward`` uses: ``(topk_ids int32 [T, k], topk_weights f32 [T, k])``
        for ``router_logits`` ``[T, num_experts]`` (see :func:`cute_moe.route`)."""
        if isinstance(router_logits, Tensor) and router_logits.dim() == 2 and router_logits.shape[1] != self.num_experts:
            _fail("FusedMoE.route", f"router_logits must be [T, num_experts = {self.num_experts}], got shape "
                              f"{list(router_logits.shape)}")  # fmt: skip
        return Fn.route(
            router_logits,
            self.top_k,
            self.routing_method,
            score_bias=self.score_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    # ------------------------------------------------------------------ module plumbing

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "FusedMoE":
        """Device moves apply to the buffers; dtype casts do not (FP8 codes, f32 scales and bias stay).

        ``fn`` is first applied to an empty tensor of the buffer's dtype and device, which tells where
        and in what dtype ``fn`` would put it; a dtype change is then dropped and only the device kept.
        """
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            probe = fn(buf.new_empty(0))
            self._buffers[name] = fn(buf) if probe.dtype == buf.dtype else buf.to(device=probe.device)
        if recurse:
            for child in self.children():
                child._apply(fn)
        for p in self._parameters.values():
            if p is not None:
                raise NotImplementedError("cute_moe.FusedMoE: holds buffers only, no parameters")
        return self

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        """A state dict's tensors must have the buffers' dtypes: ``copy_`` would otherwise convert
        (bf16 weights into FP8 codes) without a word."""
        for name, buf in self._buffers.items():
            t = state_dict.get(prefix + name)
            if buf is None or not isinstance(t, Tensor):
                continue
            key = f"state_dict[{prefix + name!r}]"
            if t.dtype != buf.dtype:
                _fail("FusedMoE", f"{key} must be {buf.dtype}, got {t.dtype}", TypeError)
            # what the constructors check: the ops cannot without a host sync per call
            if name in ("w13_scale", "w2_scale"):
                _check_block_scales("FusedMoE", key, t)
            elif name == "score_bias":
                V.check_bias_values("FusedMoE", key, t)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        s = (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, routing_method={self.routing_method!r}"
        )
        if self.routing_method == "deepseek_v3":
            s += f", n_group={self.n_group}, topk_group={self.topk_group}, score_bias={self.score_bias is not None}"
        if self.routed_scaling_factor != 1.0:
            s += f", routed_scaling_factor={self.routed_scaling_factor}"
        if self.num_local_experts != self.num_experts:
            s += f", experts=[{self.expert_offset}, {self.expert_offset + self.num_local_experts})"
        if not self.gate_first:
            s += ", gate_first=False"
        if self.act_scale_fmt is not None:
            s += f", act_scale_fmt={self.act_scale_fmt!r}"
        if self.apply_router_weight_on_input != (self.routing_method == "llama4"):  # not the method's default
            s += f", apply_router_weight_on_input={self.apply_router_weight_on_input}"
        return s

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_fp8(
        cls,
        w13: Tensor,
        w13_scale: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        *,
        top_k: int,
        num_experts: Optional[int] = None,
        routing_method: str = "renormalize",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        score_bias: Optional[Tensor] = None,
        expert_offset: int = 0,
        gate_first: bool = True,
        act_scale_fmt: Optional[str] = None,
        apply_router_weight_on_input: Optional[bool] = None,
    ) -> "FusedMoE":
        """A layer over already quantized weights (kept as they are, no copy when contiguous).

        Args:
            w13: ``[E_local, 2I, H]`` float8_e4m3fn, rows in the order ``gate_first`` names.
            w13_scale: ``[E_local, 2I/128, H/128]`` f32.
            w2: ``[E_local, H, I]`` float8_e4m3fn.
            w2_scale: ``[E_local, H/128, I/128]`` f32.
            num_experts: global expert count; defaults to ``expert_offset + E_local``.
            score_bias: ``[num_experts]`` float (kept as f32), ``deepseek_v3`` only.
            The rest: see :class:`FusedMoE`.
        """
        where = "FusedMoE.from_fp8"
        if not isinstance(w13, Tensor):
            _fail(where, f"w13 must be a torch.Tensor, got {type(w13).__name__}", TypeError)
        if w13.dim() != 3 or w13.shape[1] % (2 * _B) or w13.shape[2] % _B:
            _fail(where, f"w13 must be [E_local, 2I, H] with I and H multiples of {_B}, got shape {list(w13.shape)}")
        e_local, two_i, H = (int(d) for d in w13.shape)
        if 0 in (e_local, two_i, H):  # (the constructor would name its own arguments)
            _fail(where, f"w13 must have E_local, 2I and H >= 1, got shape {list(w13.shape)}")
        I = two_i // 2
        f32 = (torch.float32,)
        _check_tensor(where, "w13", w13, (_FP8,), (e_local, two_i, H), "[E_local, 2I, H]")
        _check_tensor(where, "w13_scale", w13_scale, f32, (e_local, two_i // _B, H // _B), "[E_local, 2I/128, H/128]")
        _check_tensor(where, "w2", w2, (_FP8,), (e_local, H, I), "[E_local, H, I]")
        _check_tensor(where, "w2_scale", w2_scale, f32, (e_local, H // _B, I // _B), "[E_local, H/128, I/128]")
        for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            if t.device != w13.device:
                _fail(where, f"all weights must be on one device: w13 is on {w13.device}, {name} is on {t.device}")
        _check_block_scales(where, "w13_scale", w13_scale)
        _check_block_scales(where, "w2_scale", w2_scale)
        if num_experts is None:
            V.check_int(where, "expert_offset", expert_offset, min=0)
            num_experts = expert_offset + e_local
        layer = cls(
            num_experts, top_k, H, I, routing_method=routing_method, n_group=n_group, topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor, has_score_bias=score_bias is not None,
            expert_offset=expert_offset, num_local_experts=e_local, gate_first=gate_first,
            act_scale_fmt=act_scale_fmt, apply_router_weight_on_input=apply_router_weight_on_input, device="meta",
        )  # fmt: skip
        bias = _check_score_bias(where, score_bias, layer.num_experts)
        if bias is not None and not w13.is_meta:
            _check_not_meta(where, "score_bias", bias, f"copy to the weights' device ({w13.device})")
        # Detached: the layer is inference-only, and buffers that keep their source's autograd
        # graph (an nn.Parameter's) hold its memory and break copy.deepcopy.
        layer.w13 = w13.detach().contiguous()
        layer.w13_scale = w13_scale.detach().contiguous()
        layer.w2 = w2.detach().contiguous()
        layer.w2_scale = w2_scale.detach().contiguous()
        if bias is not None:
            layer.score_bias = bias.detach().to(w13.device).contiguous()
        return layer

    @classmethod
    def from_bf16(
        cls,
        w13: Union[Tensor, tuple[Any, Any]],
        w2: Union[Tensor, Sequence[Tensor]],
        *,
        top_k: int,
        num_experts: Optional[int] = None,
        routing_method: str = "renormalize",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        score_bias: Optional[Tensor] = None,
        expert_offset: int = 0,
        num_local_experts: Optional[int] = None,
        gate_first: bool = True,
        act_scale_fmt: Optional[str] = None,
        apply_router_weight_on_input: Optional[bool] = None,
        device: Optional[Union[torch.device, str]] = None,
    ) -> "FusedMoE":
        """Quantize high-precision expert weights with 128x128 blocks (``reference.quant_block_128x128_ref``).

        Args:
            w13: either the fused ``[E, 2I, H]`` tensor with the **gate rows first** (the layout of
                transformers' fused ``experts.gate_up_proj`` for DeepSeek-V3, Qwen3-MoE and Mixtral,
                whatever ``gate_first`` the layer uses; Llama-4 stores the transpose ``[E, H, 2I]``: pass
                ``gate_up_proj.transpose(1, 2)``), or a pair ``(gate_proj, up_proj)``, each ``[E, I, H]``
                or a sequence of ``E`` tensors ``[I, H]``. Interleaved gate/up rows (gpt-oss) are not
                this layout.
            w2: ``[E, H, I]`` (HF's ``experts.down_proj``) or a sequence of ``E`` tensors ``[H, I]``.
            num_experts: global expert count; defaults to the weights' expert count ``E``.
            expert_offset, num_local_experts: the slice this layer owns. The weights hold either every
                expert (``E == num_experts``: the slice is taken from them) or only the slice
                (``E == num_local_experts``).
            device: where to quantize and keep the weights (default: the weights' device).
            The rest: see :class:`FusedMoE`.

        The weights may be bf16, fp16 or f32. Each expert is quantized on its own, so the peak extra
        memory is one expert's f32 copy.
        """
        where = "FusedMoE.from_bf16"
        if isinstance(w13, Tensor):
            if w13.dim() != 3:
                _fail(where, f"w13 must be [E, 2I, H] (gate rows first), got shape {list(w13.shape)}")
            if w13.shape[1] % 2:
                _fail(where, f"w13.shape[1] = 2I must be even, got {w13.shape[1]}")
            half = w13.shape[1] // 2
            gate = _Experts(where, "w13[:, :I]", w13[:, :half])
            up = _Experts(where, "w13[:, I:]", w13[:, half:])
        elif isinstance(w13, (tuple, list)) and len(w13) == 2:
            gate = _Experts(where, "w13[0] (gate_proj)", w13[0])
            up = _Experts(where, "w13[1] (up_proj)", w13[1])
        else:
            _fail(
                where,
                f"w13 must be a tensor [E, 2I, H] or a pair (gate_proj, up_proj), got {type(w13).__name__}",
                TypeError,
            )
        down = _Experts(where, "w2", w2)
        E_w = gate.count
        for ex in (up, down):
            if ex.count != E_w:
                _fail(where, f"{ex.name} must hold {E_w} experts (like {gate.name}), got {ex.count}")
        I, H = gate.shape(0)
        if num_experts is None:
            num_experts = E_w
        e_local = _check_config(
            where, num_experts, top_k, H, I, routing_method, n_group, topk_group, routed_scaling_factor,
            score_bias is not None, expert_offset, num_local_experts, gate_first, act_scale_fmt,
            apply_router_weight_on_input,
        )  # fmt: skip
        if E_w == num_experts:
            first = expert_offset
        elif E_w == e_local:
            first = 0
        else:
            _fail(
                where,
                f"the weights must hold num_experts = {num_experts} experts or num_local_experts = {e_local}, "
                f"got {E_w}",
            )
        bias = _check_score_bias(where, score_bias, num_experts)
        dev = V.as_device(where, "device", device) or gate.device
        if dev.type == "meta":
            _fail(where, "device is meta: from_bf16 quantizes the weights, which needs their data (a layer "
                         "without data: FusedMoE(..., device='meta'))")  # fmt: skip
        if bias is not None:
            _check_not_meta(where, "score_bias", bias, f"copy to {dev}")
        q13, s13, q2, s2 = _empty_fp8_weights(e_local, H, I, dev)
        gate_rows, up_rows = _half_rows(I, gate_first)
        with torch.no_grad():  # the weights are often nn.Parameters: keep no graph of them
            for j in range(e_local):
                e = first + j
                for ex, rows in ((gate, gate_rows), (up, up_rows)):
                    q13[j, rows[0]], s13[j, rows[1]] = R.quant_block_128x128_ref(ex.get(e, (I, H), "[I, H]").to(dev))
                q2[j], s2[j] = R.quant_block_128x128_ref(down.get(e, (H, I), "[H, I]").to(dev))
        # A non-finite weight makes its block's scale inf or NaN (and the layer's output NaN): the
        # scales, 1/16384 of the weights, show it without a second pass over the weights.
        for name, s in (("w13", s13), ("w2", s2)):
            bad = ~torch.isfinite(s).flatten(1).all(1)
            if bool(bad.any()):
                _fail(where, f"{name}[{first + int(bad.nonzero()[0])}] must be finite (a non-finite weight makes its "
                             "128x128 block's scale inf or NaN, and the layer's output NaN)")  # fmt: skip
        return cls.from_fp8(
            q13, s13, q2, s2, top_k=top_k, num_experts=num_experts, routing_method=routing_method, n_group=n_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
            score_bias=None if bias is None else bias.to(dev), expert_offset=expert_offset,
            gate_first=gate_first, act_scale_fmt=act_scale_fmt,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )  # fmt: skip

    @classmethod
    def from_hf_fp8(
        cls,
        checkpoint: Checkpoint,
        prefix: str,
        num_experts: int,
        top_k: int,
        *,
        routing_method: str = "renormalize",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        expert_offset: int = 0,
        num_local_experts: Optional[int] = None,
        gate_first: bool = True,
        act_scale_fmt: Optional[str] = None,
        apply_router_weight_on_input: Optional[bool] = None,
        proj_names: tuple[str, str, str] = _HF_PROJ_NAMES,
        device: Optional[Union[torch.device, str]] = None,
    ) -> "FusedMoE":
        """Load one MoE layer from a HuggingFace FP8 checkpoint (DeepSeek-V3 ``weight_scale_inv`` format).

        Per expert ``e`` of the local slice it reads ``{prefix}experts.{e}.{gate_proj,up_proj}.weight``
        (float8_e4m3fn ``[I, H]``) with ``.weight_scale_inv`` (``[ceil(I/128), ceil(H/128)]``, f32, bf16,
        fp16 or e8m0, kept as f32) and ``{prefix}experts.{e}.down_proj.weight`` (``[H, I]``) with its
        scales. For ``deepseek_v3`` routing also the selection bias (``[num_experts]``) when present,
        under ``{prefix}gate.e_score_correction_bias`` (DeepSeek-V3, Kimi-K2, GLM-4.5),
        ``{prefix}e_score_correction_bias`` (MiniMax-M2) or ``{prefix}expert_bias`` (AFMoE, LFM2-MoE);
        with another method such a key is refused, as is ERNIE-4.5's softmax selection bias
        (``{prefix}moe_statics.e_score_correction_bias``), which no method computes. ``{prefix}gate.weight``
        (the router) is **not** loaded: ``forward`` takes router logits.

        Args:
            checkpoint: a state dict (``str -> Tensor``, e.g. the whole model's), the path of a
                ``.safetensors`` file, a list of such paths (a sharded checkpoint), or a directory holding
                ``model.safetensors.index.json`` or ``*.safetensors`` files. Files are opened lazily
                (``safetensors.safe_open``): only the local experts' tensors are read.
            prefix: the keys' prefix up to ``experts.``, e.g. ``"model.layers.3.mlp."``
                (a missing trailing ``.`` is added).
            num_experts: global expert count.
            expert_offset, num_local_experts: the slice of experts to load (expert parallelism).
            proj_names: the names of the gate, up and down projections: ``("gate_proj", "up_proj",
                "down_proj")`` (DeepSeek-V3, Qwen3-MoE) or ``("w1", "w3", "w2")`` (Mixtral).
            device: where to load the tensors (default: CPU for files, as stored for a dict).
            The rest: see :class:`FusedMoE`.

        Raises:
            ValueError naming the key for a missing tensor or a wrong shape; TypeError for a wrong dtype.
        """
        where = "FusedMoE.from_hf_fp8"
        if not isinstance(prefix, str):
            _fail(where, f"prefix must be a str, got {type(prefix).__name__}", TypeError)
        if prefix and not prefix.endswith("."):
            prefix += "."
        if (
            not isinstance(proj_names, (tuple, list))
            or len(proj_names) != 3
            or not all(isinstance(n, str) for n in proj_names)
        ):
            _fail(where, f"proj_names must be three str (gate, up, down), got {proj_names!r}", TypeError)
        if len(set(proj_names)) != 3:
            _fail(where, f"proj_names must be three distinct names (gate, up, down), got {tuple(proj_names)!r}")
        # The configuration first (H and I are checked once the first expert is read).
        e_local = _check_config(
            where, num_experts, top_k, _B, _B, routing_method, n_group, topk_group, routed_scaling_factor,
            False, expert_offset, num_local_experts, gate_first, act_scale_fmt, apply_router_weight_on_input,
        )  # fmt: skip
        src = _TensorSource(where, checkpoint, device)
        gate_n, up_n, down_n = proj_names

        def key(e: int, proj: str, scale: bool = False) -> str:
            return f"{prefix}experts.{e}.{proj}.{'weight_scale_inv' if scale else 'weight'}"

        if key(num_experts, gate_n) in src:
            _fail(where, f"the checkpoint holds {key(num_experts, gate_n)!r}: num_experts = {num_experts} must be the "
                         "layer's expert count (the router's), not fewer")  # fmt: skip
        first = key(expert_offset, gate_n)
        w0 = src.get(first, f"expert {expert_offset}'s {gate_n} weight")
        if not isinstance(w0, Tensor) or w0.dim() != 2:
            got = list(w0.shape) if isinstance(w0, Tensor) else type(w0).__name__
            _fail(where, f"{first!r} must be a 2-D tensor [I, H], got {got}")
        I, H = (int(d) for d in w0.shape)
        for name, v in (("H", H), ("I", I)):
            if v % _B:
                _fail(
                    where,
                    f"{first!r} has shape [I, H] = [{I}, {H}]: {name} must be a multiple of {_B} "
                    f"(the 1x128 FP8 activation groups)",
                )
        q13, s13, q2, s2 = _empty_fp8_weights(e_local, H, I, w0.device)
        gate_rows, up_rows = _half_rows(I, gate_first)

        def load(e: int, proj: str, n: int, k: int, what: str) -> tuple[Tensor, Tensor]:
            wk, sk = key(e, proj), key(e, proj, scale=True)
            w = src.get(wk, f"expert {e}'s {proj} weight")
            s = src.get(sk, f"expert {e}'s {proj} block scales")
            _check_tensor(where, repr(wk), w, (_FP8,), (n, k), what)
            _check_tensor(
                where, repr(sk), s, _HF_SCALE_DTYPES, (_cdiv(n, _B), _cdiv(k, _B)),
                f"[ceil({what[1]}/128), ceil({what[4]}/128)]",
            )  # fmt: skip
            for name, t in ((wk, w), (sk, s)):
                _check_not_meta(where, repr(name), t, "load")
            s = s.float()
            _check_block_scales(where, repr(sk), s)  # (e8m0's 0xFF reads as NaN)
            return w, s

        for j in range(e_local):
            e = expert_offset + j
            for proj, rows in ((gate_n, gate_rows), (up_n, up_rows)):
                q13[j, rows[0]], s13[j, rows[1]] = load(e, proj, I, H, "[I, H]")
            q2[j], s2[j] = load(e, down_n, H, I, "[H, I]")
        src.close()

        bias = None
        softmax_bias = prefix + _HF_SOFTMAX_BIAS_KEY
        if softmax_bias in src:
            _fail(where, f"the checkpoint has {softmax_bias!r}: ERNIE-4.5's selection bias on softmax scores, which "
                         "no routing_method computes; route with the model's code and call forward_routed (load "
                         "the experts from a state dict without that key)")  # fmt: skip
        found = [prefix + k for k in _HF_SCORE_BIAS_KEYS if prefix + k in src]
        if len(found) > 1:
            _fail(where, f"the checkpoint has more than one routing bias: {found}")
        if found:
            bias_key = found[0]
            if routing_method != "deepseek_v3":
                _fail(
                    where,
                    f"the checkpoint has {bias_key!r} (a sigmoid routing's selection bias), which routing_method="
                    f"{routing_method!r} would ignore: use routing_method='deepseek_v3' (n_group=1 without groups)",
                )
            b = src.get(bias_key, "the routing bias")
            _check_tensor(where, repr(bias_key), b, _FLOAT_W, (num_experts,), "[num_experts]")
            _check_not_meta(where, repr(bias_key), b, "load")
            V.check_bias_values(where, repr(bias_key), b)
            bias = b.float()
        elif routing_method == "deepseek_v3":
            # Legal (grouped top-k without a bias), but a DeepSeek-V3 checkpoint always has one: a
            # wrong prefix or a dropped key would otherwise change the routing without a word.
            looked = [prefix + k for k in _HF_SCORE_BIAS_KEYS]
            warnings.warn(f"cute_moe.{where}: routing_method='deepseek_v3' and the checkpoint has none of {looked}: "
                          "routing without a score bias", stacklevel=2)  # fmt: skip
        return cls.from_fp8(
            q13, s13, q2, s2, top_k=top_k, num_experts=num_experts, routing_method=routing_method, n_group=n_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, score_bias=bias,
            expert_offset=expert_offset, gate_first=gate_first, act_scale_fmt=act_scale_fmt,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )  # fmt: skip


def _empty_fp8_weights(e_local: int, H: int, I: int, device: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised (w13, w13_scale, w2, w2_scale) for E_local experts; every element is written by the caller."""
    return (
        torch.empty(e_local, 2 * I, H, dtype=_FP8, device=device),
        torch.empty(e_local, 2 * I // _B, H // _B, dtype=torch.float32, device=device),
        torch.empty(e_local, H, I, dtype=_FP8, device=device),
        torch.empty(e_local, H // _B, I // _B, dtype=torch.float32, device=device),
    )


def _half_rows(I: int, gate_first: bool) -> tuple[tuple[slice, slice], tuple[slice, slice]]:
    """((gate rows, gate scale rows), (up rows, up scale rows)) of w13 / w13_scale."""
    ib = I // _B
    lo, hi = (slice(0, I), slice(0, ib)), (slice(I, 2 * I), slice(ib, 2 * ib))
    return (lo, hi) if gate_first else (hi, lo)


class _Experts:
    """Per-expert access to a [E, N, K] tensor or a sequence of E [N, K] tensors (for from_bf16)."""

    def __init__(self, where: str, name: str, v: Any) -> None:
        self.where, self.name = where, name
        if isinstance(v, Tensor):
            if v.dim() != 3:
                _fail(where, f"{name} must be [E, N, K] or a sequence of [N, K] tensors, got shape {list(v.shape)}")
            self.items: Sequence[Any] = v
            self.count = v.shape[0]
        elif isinstance(v, (list, tuple)):
            self.items, self.count = v, len(v)
        else:
            _fail(where, f"{name} must be a tensor or a sequence of tensors, got {type(v).__name__}", TypeError)
        if self.count == 0:
            _fail(where, f"{name} must hold at least one expert")
        first = self.items[0]
        if not isinstance(first, Tensor):
            _fail(where, f"{name}[0] must be a torch.Tensor, got {type(first).__name__}", TypeError)
        self.device = first.device

    def shape(self, e: int) -> tuple[int, int]:
        t = self.items[e]
        if not isinstance(t, Tensor) or t.dim() != 2:
            got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
            _fail(self.where, f"{self.name}[{e}] must be a 2-D tensor, got {got}")
        return int(t.shape[0]), int(t.shape[1])

    def get(self, e: int, shape: tuple[int, int], what: str) -> Tensor:
        t = self.items[e]
        _check_tensor(self.where, f"{self.name}[{e}]", t, _FLOAT_W, shape, what)
        _check_not_meta(self.where, f"{self.name}[{e}]", t, "quantize")
        return t


class _TensorSource:
    """Key -> tensor from a state dict or safetensors file(s), reading only the tensors asked for."""

    def __init__(self, where: str, checkpoint: Any, device: Optional[Union[torch.device, str]]) -> None:
        self.where = where
        self.device = V.as_device(where, "device", device)
        if self.device is not None and self.device.type == "meta":
            _fail(where, "device is meta: from_hf_fp8 loads the checkpoint's data (a layer without data: "
                         "FusedMoE(..., device='meta'))")  # fmt: skip
        self.what = "state_dict"
        self._dict: Optional[Mapping[str, Any]] = None
        self._files: dict[str, list[str]] = {}  # key -> the files holding it (the index's one file, if any)
        self._index: dict[str, str] = {}  # key -> file, from a model.safetensors.index.json
        self._open: dict[str, Any] = {}  # file -> safe_open handle
        if isinstance(checkpoint, Mapping):
            self._dict = checkpoint
            return
        if isinstance(checkpoint, (str, os.PathLike)):
            path = os.fspath(checkpoint)
            if os.path.isdir(path):
                files = self._dir_files(path)
            elif os.path.isfile(path) and path.endswith(".json"):  # the index itself: its directory's shards
                files = self._index_files(path)
            elif os.path.isfile(path):
                files = [path]
            else:
                _fail(where, f"checkpoint {path!r} is neither a file nor a directory")
            self.what = repr(path)
        elif isinstance(checkpoint, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in checkpoint):
            files = [os.fspath(p) for p in checkpoint]
            if not files:
                _fail(where, "checkpoint must name at least one .safetensors file, got an empty list")
            self.what = f"{len(files)} safetensors files"
        else:
            _fail(
                where,
                "checkpoint must be a state dict (Mapping[str, Tensor]), a .safetensors path, a list of them or a "
                f"directory, got {type(checkpoint).__name__}",
                TypeError,
            )
        try:
            from safetensors import safe_open  # noqa: PLC0415 (optional dependency, only for files)
        except ImportError as exc:
            _fail(where, f"loading .safetensors files needs the safetensors package ({exc})", ImportError)
        self._safe_open = safe_open
        for f in files:
            try:
                handle = safe_open(f, framework="pt")
            except FileNotFoundError:
                _fail(where, f"checkpoint file {f!r} does not exist", FileNotFoundError)
            except Exception as exc:  # safetensors' own error type (a header it cannot parse, ...)
                _fail(where, f"checkpoint file {f!r} is not a readable .safetensors file: {exc}")
            with handle as h:
                for k in h.keys():
                    if k in self._index:
                        self._files[k] = [self._index[k]]
                    else:
                        self._files.setdefault(k, []).append(f)

    def _dir_files(self, path: str) -> list[str]:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            return self._index_files(index)
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            _fail(self.where, f"checkpoint directory {path!r} holds no .safetensors files")
        return files

    def _index_files(self, index: str) -> list[str]:
        """The shards a ``model.safetensors.index.json`` maps tensors to, each checked to exist."""
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            folder = os.path.dirname(index)
            self._index = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            _fail(self.where, f"checkpoint index {index!r} is not a safetensors index (a JSON weight_map of "
                              f"tensor name -> file name): {exc}")  # fmt: skip
        files = sorted(set(self._index.values()))
        if not files:
            _fail(self.where, f"checkpoint index {index!r} maps no tensor to a file")
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            _fail(self.where, f"checkpoint index {index!r} names shards that do not exist: {missing[:3]}")
        return files

    def __contains__(self, key: str) -> bool:
        return key in self._dict if self._dict is not None else key in self._files

    def get(self, key: str, what: str) -> Tensor:
        if key not in self:
            _fail(self.where, f"checkpoint {self.what} is missing {key!r} ({what})")
        if self._dict is not None:
            t = self._dict[key]
            if self.device is not None and isinstance(t, Tensor):
                t = t.to(self.device)
            return t
        if len(self._files[key]) > 1:  # no index says which: a stale shard beside the current ones?
            _fail(self.where, f"checkpoint {self.what}: {key!r} is in more than one file: {self._files[key]}")
        f = self._files[key][0]
        if f not in self._open:
            dev = "cpu" if self.device is None else str(self.device)
            self._open[f] = self._safe_open(f, framework="pt", device=dev)
        return self._open[f].get_tensor(key)

    def close(self) -> None:
        self._open.clear()
