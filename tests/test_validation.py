"""Bad inputs to every op raise TypeError / ValueError naming the op, the argument and the rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import cute_moe
from cute_moe import reference as R
from cute_moe import validation as V

BF16, F16, F32, I32, I64, FP8 = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
)
T, K, H, I, E = 4, 256, 256, 128, 3


def _r(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _good(op: str) -> dict[str, Any]:
    """Valid keyword arguments for ``op`` (small, random)."""
    ids = torch.randperm(8)[: 2 * T].reshape(T, 2).to(I32)
    off, r2t, t2r, counts = R.align_ref(ids, 8, 8)
    M = r2t.shape[0]
    if op == "quant_fp8":
        return {"x": _r(T, K)}
    if op == "route":
        return {"router_logits": _r(T, 16, dtype=F32), "top_k": 2, "method": "softmax"}
    if op == "align":
        return {"topk_ids": ids, "num_experts": 8}
    if op == "permute_quant":
        return {"x": _r(T, H), "row_to_token": r2t, "expert_offsets": off, "token_to_row": t2r}
    if op == "permute":
        return {"a_in": _r(T, H, dtype=FP8), "a_in_scale": torch.rand(T, 2), "row_to_token": r2t, "expert_offsets": off}
    if op == "grouped_gemm_fp8":
        off3 = torch.tensor([0, 8, 8, M], dtype=I32)
        return {
            "a": _r(M, K, dtype=FP8),
            "a_scale": torch.rand(M, 2),
            "b": _r(E, 128, K, dtype=FP8),
            "b_scale": torch.rand(E, 1, 2),
            "expert_offsets": off3,
        }
    if op == "grouped_gemm_fp8_swiglu":
        off3 = torch.tensor([0, 8, 8, M], dtype=I32)
        return {
            "a": _r(M, K, dtype=FP8),
            "a_scale": torch.rand(M, 2),
            "w13": _r(E, 2 * I, K, dtype=FP8),
            "w13_scale": torch.rand(E, 2 * I // 128, 2),
            "expert_offsets": off3,
        }
    if op == "silu_mul_quant":
        return {"h": _r(M, 2 * I), "expert_offsets": off, "expert_counts": counts}
    if op == "finalize":
        return {"y": _r(M, H), "topk_weights": torch.rand(T, 2), "token_to_row": t2r}
    if op == "moe_reduce":
        return {"hidden": _r(T, 2, H), "weights": torch.rand(T, 2)}
    weights = {
        "w13": _r(2, 2 * I, H, dtype=FP8),
        "w13_scale": torch.rand(2, 2, 2),
        "w2": _r(2, H, I, dtype=FP8),
        "w2_scale": torch.rand(2, 2, 1),
    }
    if op == "fused_moe_routed":
        return {"x": _r(T, H), "topk_ids": ids % 2, "topk_weights": torch.rand(T, 2), **weights}
    if op == "fused_moe":
        return {"x": _r(T, H), "router_logits": _r(T, 8, dtype=F32), **weights, "top_k": 2, "routing_method": "softmax"}
    assert op == "fill_kv_cache_fp8"
    nb, bs, hkv, d = 4, 4, 2, 128
    return {
        "k_states": _r(3, hkv, d),
        "v_states": _r(3, hkv, d),
        "k_cache": _r(nb, bs, hkv, d, dtype=FP8),
        "v_cache": _r(nb, bs, hkv, d, dtype=FP8),
        "k_scale_cache": torch.rand(nb, bs, hkv, 1),
        "v_scale_cache": torch.rand(nb, bs, hkv, 1),
        "cu_seqlens_q": torch.tensor([0, 2, 3], dtype=I32),
        "kv_seqlens": torch.tensor([2, 5], dtype=I32),
        "block_offsets": torch.tensor([[0, 1], [2, 3]], dtype=I32),
    }


def _shifted_kv_caches(g: dict, shift: int) -> dict:
    """k_cache and v_cache as two views of one buffer, V ``shift`` blocks past K: they overlap."""
    nb = g["k_cache"].shape[0]
    buf = _r(nb + shift, *g["k_cache"].shape[1:], dtype=FP8)
    return {"k_cache": buf[:nb], "v_cache": buf[shift:]}


def _bias(n: int, e: int, value: float) -> torch.Tensor:
    """A zero score bias of n experts with ``value`` at expert e."""
    return torch.zeros(n).index_fill(0, torch.tensor([e]), value)


OPS = list(cute_moe.ops.__all__)

# op -> [(overrides built from the good kwargs g, exception, message regex)]
Bad = tuple[Callable[[dict], dict], type[Exception], str]
BAD_BY_OP: dict[str, list[Bad]] = {
    "quant_fp8": [
        (lambda g: {"x": g["x"].int()}, TypeError, r"x must be one of bfloat16, float16, float32, got torch\.int32"),
        (lambda g: {"x": _r(2, 3, K)}, ValueError, r"x must be 2-D \[M, K\], got shape \[2, 3, 256\]"),
        (lambda g: {"group_size": 96}, ValueError, r"K \(x\.shape\[1\]\) must be divisible by group_size = 96"),
        (lambda g: {"group_size": 0}, ValueError, r"group_size must be >= 1, got 0"),
        (lambda g: {"group_size": 1.5}, TypeError, r"group_size must be an int, got float"),
        (lambda g: {"scale_fmt": "e8m0"}, ValueError, r"scale_fmt must be one of None, 'ue8m0', got 'e8m0'"),
        (lambda g: {"x": _r(T, 2 * K)[:, ::2]}, ValueError, r"x must have a contiguous last dimension"),
        (lambda g: {"x": [[1.0] * K]}, TypeError, r"x must be a torch.Tensor, got list"),
        # the dispatcher would take these as 1 / False without a word
        (lambda g: {"group_size": True}, TypeError, r"group_size must be an int, got bool"),
        (lambda g: {"group_size": 2**63}, ValueError, r"group_size must fit in a 64-bit int, got 9223372036854775808"),
        (lambda g: {"column_major_scales": None}, TypeError, r"column_major_scales must be a bool, got NoneType"),
        (lambda g: {"x": None}, TypeError, r"x must be a torch.Tensor, got NoneType"),
    ],
    "route": [
        (lambda g: {"top_k": torch.tensor(2.7)}, TypeError, r"top_k must be an int, got torch\.Tensor"),
        (lambda g: {"routed_scaling_factor": True}, TypeError, r"routed_scaling_factor must be a float, got bool"),
        (lambda g: {"routed_scaling_factor": 10**400}, ValueError, r"routed_scaling_factor must fit in a 64-bit float"),
        (lambda g: {"method": 3}, TypeError, r"method must be a str, got int"),
        (lambda g: {"router_logits": None}, TypeError, r"router_logits must be a torch.Tensor, got NoneType"),
        (
            lambda g: {"method": "deepseek_v3", "score_bias": _bias(16, 5, torch.nan)},
            ValueError,
            r"score_bias must not be NaN or \+inf, got nan at expert 5",
        ),
        (
            lambda g: {"method": "deepseek_v3", "score_bias": _bias(16, 9, torch.inf)},
            ValueError,
            r"score_bias must not be NaN or \+inf, got inf at expert 9",
        ),
        (lambda g: {"top_k": 0}, ValueError, r"top_k must be >= 1, got 0"),
        (lambda g: {"top_k": 17}, ValueError, r"top_k must be <= num_experts \(router_logits\.shape\[1\]\) = 16"),
        (lambda g: {"method": "topk"}, ValueError, r"method must be one of 'softmax', .*, got 'topk'"),
        (
            lambda g: {"router_logits": g["router_logits"].double()},
            TypeError,
            r"router_logits must be one of bfloat16, float16, float32, got torch\.float64",
        ),
        (lambda g: {"score_bias": torch.rand(16)}, ValueError, r"score_bias is only allowed with method='deepseek_v3'"),
        (lambda g: {"n_group": 2}, ValueError, r"n_group and topk_group must be 1 unless method='deepseek_v3'"),
        (
            lambda g: {"method": "deepseek_v3", "n_group": 3},
            ValueError,
            r"num_experts .* must be divisible by n_group = 3",
        ),
        (
            lambda g: {"method": "deepseek_v3", "n_group": 4, "topk_group": 5},
            ValueError,
            r"topk_group must be <= n_group = 4, got 5",
        ),
        (lambda g: {"routed_scaling_factor": float("nan")}, ValueError, r"routed_scaling_factor must be finite and > 0"),
        (lambda g: {"routed_scaling_factor": 0.0}, ValueError, r"routed_scaling_factor must be finite and > 0 within .*, got 0\.0"),
        (lambda g: {"routed_scaling_factor": -2.5}, ValueError, r"routed_scaling_factor must be finite and > 0"),
        (lambda g: {"routed_scaling_factor": float("inf")}, ValueError, r"routed_scaling_factor must be finite"),
        (lambda g: {"routed_scaling_factor": 1e39}, ValueError, r"within float32's normal range .* got 1e\+39"),
        (lambda g: {"routed_scaling_factor": 1e-50}, ValueError, r"within float32's normal range .* got 1e-50"),
        (
            lambda g: {"method": "deepseek_v3", "n_group": 4, "top_k": 5},
            ValueError,
            r"top_k must be <= topk_group \* \(num_experts / n_group\) = 4, got 5",
        ),
        (
            lambda g: {"method": "deepseek_v3", "score_bias": torch.rand(8)},
            ValueError,
            r"score_bias must have shape \[E\] = \[16\], got \[8\]",
        ),
        (
            lambda g: {"method": "deepseek_v3", "score_bias": torch.rand(16).bfloat16()},
            TypeError,
            r"score_bias must be float32, got torch\.bfloat16",
        ),
    ],
    "align": [
        (lambda g: {"num_local_experts": 2**63}, ValueError, r"num_local_experts must fit in a 64-bit int"),
        (lambda g: {"topk_ids": None}, TypeError, r"topk_ids must be a torch.Tensor, got NoneType"),
        (lambda g: {"alignment": True}, TypeError, r"alignment must be an int, got bool"),
        (lambda g: {"topk_ids": g["topk_ids"].long()}, TypeError, r"topk_ids must be int32, got torch\.int64"),
        (lambda g: {"topk_ids": g["topk_ids"].flatten()}, ValueError, r"topk_ids must be 2-D \[T, k\]"),
        (lambda g: {"num_experts": 0}, ValueError, r"num_experts must be >= 1"),
        (lambda g: {"alignment": 0}, ValueError, r"alignment must be >= 1"),
        (lambda g: {"num_experts": 2**31}, ValueError, r"num_experts must be <= 2\*\*31 - 1"),
        (lambda g: {"alignment": 2**31}, ValueError, r"alignment must be <= 2\*\*31 - 1"),
        (lambda g: {"alignment": 2**30}, ValueError, r"M_cap = round_up\(.*\) must fit in int32, got T = 4, k = 2, E_local = 8, alignment = 1073741824"),
        (lambda g: {"expert_offset": -1}, ValueError, r"expert_offset must be >= 0, got -1"),
        (
            lambda g: {"expert_offset": 4, "num_local_experts": 8},
            ValueError,
            r"expert_offset \+ num_local_experts must be <= num_experts, got 4 \+ 8 > 8",
        ),
        (
            lambda g: {"expert_offset": 1},
            ValueError,
            r"expert_offset \+ num_local_experts \(default num_experts\) must be <= num_experts, got 1 \+ 8 > 8",
        ),
        (lambda g: {"num_local_experts": 0}, ValueError, r"num_local_experts must be >= 1"),
        (
            lambda g: {"topk_ids": torch.zeros(T, 9, dtype=I32)},
            ValueError,
            r"top_k \(topk_ids\.shape\[1\]\) must be <= num_experts = 8, got 9",
        ),
    ],
    "permute_quant": [
        (lambda g: {"zero_padding": None}, TypeError, r"zero_padding must be a bool, got NoneType"),
        (lambda g: {"x": g["x"].float()}, TypeError, r"x must be one of bfloat16, float16, got torch\.float32"),
        (lambda g: {"x": _r(T, 200)}, ValueError, r"H \(x\.shape\[1\]\) must be divisible by 128, got 200"),
        (lambda g: {"row_to_token": g["row_to_token"].long()}, TypeError, r"row_to_token must be int32"),
        (lambda g: {"row_to_token": g["row_to_token"][None]}, ValueError, r"row_to_token must be 1-D \[M_cap\]"),
        (lambda g: {"expert_offsets": g["expert_offsets"][None]}, ValueError, r"expert_offsets must be 1-D \[E \+ 1\]"),
        (
            lambda g: {"expert_offsets": g["expert_offsets"][:1]},
            ValueError,
            r"expert_offsets must have E \+ 1 >= 2 entries",
        ),
        (lambda g: {"scale_fmt": "UE8M0"}, ValueError, r"scale_fmt must be one of"),
        (lambda g: {"zero_padding": "no"}, TypeError, r"zero_padding"),
        (
            lambda g: {"token_to_row": g["token_to_row"].float()},
            TypeError,
            r"token_to_row must be one of int32, int64, got torch\.float32",
        ),
        (
            lambda g: {"token_to_row": g["token_to_row"][:3]},
            ValueError,
            r"token_to_row must have shape \[T, k\] \(T = x\.shape\[0\]\) = \[4, \*\], got \[3, 2\]",
        ),
        (
            lambda g: {"token_to_row": g["token_to_row"].flatten()},
            ValueError,
            r"token_to_row must be 2-D \[T, k\]",
        ),
        (lambda g: {"token_to_row": [[0, 1]] * T}, TypeError, r"token_to_row must be a torch.Tensor, got list"),
    ],
    "permute": [
        (lambda g: {"a_in": g["a_in"].bfloat16()}, TypeError, r"a_in must be float8_e4m3fn, got torch\.bfloat16"),
        (lambda g: {"a_in_scale": torch.rand(T, 1)}, ValueError, r"a_in_scale must have shape \[T, H/128\] = \[4, 2\]"),
        (lambda g: {"a_in_scale": torch.rand(T, 2).half()}, TypeError, r"a_in_scale must be float32"),
        (lambda g: {"a_in": _r(T, 64, dtype=FP8)}, ValueError, r"H \(a_in\.shape\[1\]\) must be divisible by 128"),
    ],
    "grouped_gemm_fp8_swiglu": [
        (lambda g: {"w13": g["w13"].bfloat16()}, TypeError, r"w13 must be float8_e4m3fn"),
        (
            lambda g: {"w13": _r(E, 128, K, dtype=FP8), "w13_scale": torch.rand(E, 1, 2)},
            ValueError,
            r"w13\.shape\[1\] = 2I must have I divisible by 128, got 2I = 128",
        ),
        (lambda g: {"expert_counts": torch.zeros(E, dtype=I64)}, TypeError, r"expert_counts must be int32"),
        (lambda g: {"gate_first": "yes"}, TypeError, r"gate_first must be a bool, got str"),
        (lambda g: {"scale_fmt": "e8m0"}, ValueError, r"scale_fmt"),
        (lambda g: {"expected_m": -1}, ValueError, r"grouped_gemm_fp8_swiglu: expected_m must be >= 0, got -1"),
        (lambda g: {"expected_m": 2.5}, TypeError, r"expected_m"),
        (
            lambda g: {"expert_offsets": g["expert_offsets"][:3]},
            ValueError,
            r"expert_offsets must have shape \[E \+ 1\] = \[4\] \(E = w13\.shape\[0\] = 3\)",
        ),
    ],
    "grouped_gemm_fp8": [
        (lambda g: {"a": None}, TypeError, r"a must be a torch.Tensor, got NoneType"),
        (lambda g: {"a_scale": None}, TypeError, r"a_scale must be a torch.Tensor, got NoneType"),
        (
            lambda g: {"b_scale": torch.rand(E, 1, 4)[:, :, ::2]},
            ValueError,
            r"b_scale must have a contiguous last dimension",
        ),
        (
            lambda g: {"b": g["b"].bfloat16()},
            TypeError,
            r"^cute_moe\.grouped_gemm_fp8: b must be float8_e4m3fn, got torch\.bfloat16$",
        ),
        (lambda g: {"a": g["a"].bfloat16()}, TypeError, r"a must be float8_e4m3fn"),
        (lambda g: {"expected_m": -8}, ValueError, r"^cute_moe\.grouped_gemm_fp8: expected_m must be >= 0, got -8$"),
        (lambda g: {"expected_m": "64"}, TypeError, r"expected_m"),
        (
            lambda g: {"b": _r(E, 128, 128, dtype=FP8)},
            ValueError,
            r"a\.shape\[1\] \(K = 256\) must equal b\.shape\[2\] \(K = 128\)",
        ),
        (
            lambda g: {"a": g["a"][:, :192], "b": g["b"][:, :, :192]},
            ValueError,
            r"K \(b\.shape\[2\]\) must be divisible by 128, got 192",
        ),
        (lambda g: {"b": _r(E, 100, K, dtype=FP8)}, ValueError, r"N \(b\.shape\[1\]\) must be divisible by 8"),
        (
            lambda g: {"b": _r(E, 136, K, dtype=FP8)},
            ValueError,
            r"b_scale must have shape \[E, ceil\(N/128\), K/128\] = \[3, 2, 2\], got \[3, 1, 2\]",
        ),
        (lambda g: {"a_scale": g["a_scale"][1:]}, ValueError, r"a_scale must have shape \[M, K/128\]"),
        (lambda g: {"expert_counts": torch.zeros(E, dtype=I64)}, TypeError, r"expert_counts must be int32"),
        (
            lambda g: {"expert_counts": torch.zeros(E + 1, dtype=I32)},
            ValueError,
            r"expert_counts must have shape \[E\] \(E = b\.shape\[0\]\) = \[3\]",
        ),
        (
            lambda g: {"expert_offsets": g["expert_offsets"][:3]},
            ValueError,
            r"expert_offsets must have shape \[E \+ 1\] = \[4\] \(E = b\.shape\[0\] = 3\)",
        ),
        (
            lambda g: {"b": _r(E, 2 * K, 128, dtype=FP8).view(torch.uint8).mT.view(FP8)},
            ValueError,
            r"b must have a contiguous last dimension",
        ),
        (lambda g: {"b": _r(128, K, dtype=FP8)}, ValueError, r"b must be 3-D \[E, N, K\]"),
    ],
    "silu_mul_quant": [
        (lambda g: {"gate_first": None}, TypeError, r"gate_first must be a bool, got NoneType"),
        (lambda g: {"gate_first": np.bool_(True)}, TypeError, r"gate_first must be a bool, got numpy\.bool"),
        (lambda g: {"h": g["h"].half()}, TypeError, r"h must be bfloat16, got torch\.float16"),
        (lambda g: {"h": g["h"][:, :200]}, ValueError, r"h\.shape\[1\] = 2I must have I divisible by 128"),
        (lambda g: {"expert_offsets": g["expert_offsets"].float()}, TypeError, r"expert_offsets must be int32"),
        (lambda g: {"gate_first": "yes"}, TypeError, r"gate_first must be a bool, got str"),
        (lambda g: {"scale_fmt": "fp32"}, ValueError, r"scale_fmt must be one of"),
        (lambda g: {"expert_counts": g["expert_counts"].long()}, TypeError, r"expert_counts must be int32"),
        (
            lambda g: {"expert_counts": g["expert_counts"][:-1]},
            ValueError,
            r"expert_counts must have shape \[E\] \(E \+ 1 = expert_offsets\.shape\[0\]\) = \[8\], got \[7\]",
        ),
        (lambda g: {"expert_counts": g["expert_counts"][None]}, ValueError, r"expert_counts must be 1-D \[E\]"),
        (lambda g: {"expert_counts": [1] * 8}, TypeError, r"expert_counts must be a torch.Tensor, got list"),
    ],
    "finalize": [
        (lambda g: {"y": g["y"].float()}, TypeError, r"y must be bfloat16, got torch\.float32"),
        (
            lambda g: {"token_to_row": torch.zeros(T, 3, dtype=I32)},
            ValueError,
            r"token_to_row must have shape \[T, k\] \(the shape of topk_weights\) = \[4, 2\], got \[4, 3\]",
        ),
        (lambda g: {"topk_weights": g["topk_weights"].bfloat16()}, TypeError, r"topk_weights must be float32"),
        (lambda g: {"y": g["y"][None]}, ValueError, r"y must be 2-D \[M_cap, H\]"),
    ],
    "moe_reduce": [
        (lambda g: {"hidden": g["hidden"][0]}, ValueError, r"hidden must be 3-D \[T, k, H\]"),
        (lambda g: {"weights": torch.rand(T, 3)}, ValueError, r"weights must have shape \[T, k\]"),
        (lambda g: {"hidden": g["hidden"].int()}, TypeError, r"hidden must be one of bfloat16, float16, float32"),
        (lambda g: {"weights": g["weights"].double()}, TypeError, r"weights must be float32, got torch\.float64"),
    ],
    "fused_moe_routed": [
        (lambda g: {"expert_offset": True}, TypeError, r"expert_offset must be an int, got bool"),
        (lambda g: {"gate_first": None}, TypeError, r"gate_first must be a bool, got NoneType"),
        (lambda g: {"x": g["x"].float()}, TypeError, r"x must be one of bfloat16, float16, got torch\.float32"),
        (lambda g: {"num_experts": 0}, ValueError, r"fused_moe_routed: num_experts must be >= 1, got 0"),
        (lambda g: {"num_experts": 8.0}, TypeError, r"num_experts"),
        (
            lambda g: {"num_experts": 7, "expert_offset": 6},
            ValueError,
            r"expert_offset \+ E_local \(w13\.shape\[0\]\) must be <= num_experts, got 6 \+ 2 > 7",
        ),
        (
            lambda g: {"topk_weights": g["topk_weights"].double()},
            TypeError,
            r"topk_weights must be one of bfloat16, float16, float32, got torch\.float64",
        ),
        (
            lambda g: {"w13": g["w13"][:, :, :128]},
            ValueError,
            r"x.shape\[1\] \(H = 256\) must equal w13.shape\[2\] \(H = 128\)",
        ),
        (lambda g: {"w2": _r(2, H, 2 * I, dtype=FP8)}, ValueError, r"w2 must have K = 128"),
        (lambda g: {"w2": _r(3, H, I, dtype=FP8)}, ValueError, r"w2 must have E = 2"),
        (
            lambda g: {"w13": _r(2, 384, H, dtype=FP8), "w13_scale": torch.rand(2, 3, 2)},
            ValueError,
            r"w13\.shape\[1\] = 2I must have I divisible by 128, got 2I = 384",
        ),
        (lambda g: {"w2_scale": torch.rand(2, 2, 2)}, ValueError, r"w2_scale must have shape"),
        (
            lambda g: {"topk_ids": torch.zeros(T + 1, 2, dtype=I32), "topk_weights": torch.rand(T + 1, 2)},
            ValueError,
            r"topk_weights\.shape\[0\] must equal the number of tokens T = 4, got 5",
        ),
        (lambda g: {"expert_offset": -1}, ValueError, r"expert_offset must be >= 0"),
        (lambda g: {"act_scale_fmt": "e4m3"}, ValueError, r"act_scale_fmt must be one of None, 'ue8m0'"),
        (lambda g: {"x": _r(T, 192)}, ValueError, r"H \(x\.shape\[1\]\) must be divisible by 128"),
        (lambda g: {"x": _r(T, 0)}, ValueError, r"H \(x\.shape\[1\]\) must be >= 128, got 0"),
        (
            lambda g: {"w13": _r(2, 0, H, dtype=FP8), "w13_scale": torch.rand(2, 0, 2), "w2": _r(2, H, 0, dtype=FP8),
                       "w2_scale": torch.rand(2, 2, 0)},
            ValueError,
            r"w13\.shape\[1\] = 2I must have I >= 128, got 2I = 0",
        ),
        (lambda g: {"w13_scale": torch.rand(2, 2, 4)[:, :, ::2]}, ValueError, r"w13_scale must have a contiguous last"),
        (lambda g: {"expert_offset": 2**31 - 2}, ValueError, r"expert_offset must be <= 2\*\*31 - 1 - E_local = 2147483645"),
    ],
    "fused_moe": [
        (lambda g: {"top_k": True}, TypeError, r"top_k must be an int, got bool"),
        (
            lambda g: {"routing_method": "deepseek_v3", "score_bias": torch.full((8,), torch.nan)},
            ValueError,
            r"score_bias must not be NaN or \+inf, got nan at expert 0",
        ),
        (
            lambda g: {"routing_method": "deepseek_v3", "score_bias": _bias(8, 3, torch.inf)},
            ValueError,
            r"score_bias must not be NaN or \+inf, got inf at expert 3",
        ),
        (lambda g: {"num_experts": 16}, ValueError, r"num_experts must equal router_logits\.shape\[1\] = 8"),
        (
            lambda g: {"expert_offset": 7},
            ValueError,
            r"expert_offset \+ E_local \(w13\.shape\[0\]\) must be <= num_experts \(router_logits\.shape\[1\]\), got 7 \+ 2 > 8",
        ),
        (lambda g: {"routing_method": "sigmoid"}, ValueError, r"routing_method must be one of"),
        (
            lambda g: {"router_logits": _r(T + 1, 8, dtype=F32)},
            ValueError,
            r"router_logits\.shape\[0\] must equal the number of tokens T = x\.shape\[0\] = 4, got 5",
        ),
        (
            lambda g: {"score_bias": torch.rand(8), "routing_method": "renormalize"},
            ValueError,
            r"score_bias is only allowed with routing_method='deepseek_v3', got routing_method='renormalize'",
        ),
        (lambda g: {"top_k": 9}, ValueError, r"top_k must be <= num_experts"),
        (lambda g: {"w13": g["w13"].bfloat16()}, TypeError, r"w13 must be float8_e4m3fn"),
    ],
    "fill_kv_cache_fp8": [
        (
            lambda g: {"cu_seqlens_q": torch.tensor([0, 3, 2], dtype=I32)},
            ValueError,
            r"cu_seqlens_q must be non-decreasing, got \[0, 3, 2\]",
        ),
        (  # a decrease past int32's range: an int32 difference would wrap to a positive length
            lambda g: {"cu_seqlens_q": torch.tensor([0, 3, -(2**31)], dtype=I32)},
            ValueError,
            r"cu_seqlens_q must be non-decreasing",
        ),
        (
            lambda g: {"v_cache": None},
            ValueError,
            r"v_states, v_cache and v_scale_cache must be all None .* got v_states=Tensor, v_cache=None, v_scale_cache=Tensor",
        ),
        (lambda g: {"layout": "bsdh"}, ValueError, r"layout must be one of 'bshd', 'bhsd', got 'bsdh'"),
        (lambda g: {"group_size": 96}, ValueError, r"D \(k_states\.shape\[2\]\) must be divisible by group_size = 96"),
        (lambda g: {"k_cache": g["k_cache"].bfloat16()}, TypeError, r"k_cache must be float8_e4m3fn"),
        (lambda g: {"layout": "bhsd"}, ValueError, r"k_cache must have H_kv = 2 and D = 128"),
        (
            lambda g: {"k_scale_cache": torch.rand(4, 4, 2, 2)},
            ValueError,
            r"k_scale_cache must have shape .* = \[4, 4, 2, 1\], got \[4, 4, 2, 2\]",
        ),
        (lambda g: {"kv_seqlens": torch.tensor([2, 5, 1], dtype=I32)}, ValueError, r"kv_seqlens must have shape \[B\]"),
        (
            lambda g: {"block_offsets": g["block_offsets"].flatten()},
            ValueError,
            r"block_offsets must be 2-D \[B, max_blocks\]",
        ),
        (lambda g: {"v_states": g["v_states"].half()}, TypeError, r"v_states must be bfloat16"),
        (
            lambda g: {"v_cache": g["v_cache"][:, :2], "v_scale_cache": g["v_scale_cache"][:, :2]},
            ValueError,
            r"v_states / v_cache must match the K side",
        ),
        (lambda g: {"cu_seqlens_q": g["cu_seqlens_q"].long()}, TypeError, r"cu_seqlens_q must be int32"),
        (lambda g: {"k_states": g["k_states"][0]}, ValueError, r"k_states must be 3-D \[N_tok, H_kv, D\]"),
        (
            lambda g: {"k_cache": _r(4, 0, 2, 128, dtype=FP8), "v_cache": _r(4, 0, 2, 128, dtype=FP8),
                       "k_scale_cache": torch.rand(4, 0, 2, 1), "v_scale_cache": torch.rand(4, 0, 2, 1)},
            ValueError,
            r"k_cache must have block_size >= 1",
        ),
        (
            lambda g: {"k_cache": _r(1, 1, 2, 128, dtype=FP8).expand(4, 4, 2, 128)},
            ValueError,
            r"k_cache must have strides that nest .* got strides \(0, 0, 128, 1\) for shape",
        ),
        (
            lambda g: {"k_cache": _r(4 * 4 * 2 * 128, dtype=FP8).as_strided((4, 4, 2, 128), (128, 64, 128, 1))},
            ValueError,
            r"k_cache must have strides that nest .* got strides \(128, 64, 128, 1\)",
        ),
        (lambda g: {"v_cache": g["k_cache"]}, ValueError, r"v_cache must not share memory with k_cache"),
        (lambda g: {"v_scale_cache": g["k_scale_cache"]}, ValueError, r"v_scale_cache must not share memory with k_scale"),
        (
            lambda g: _shifted_kv_caches(g, 1),
            ValueError,
            r"v_cache must not share memory with k_cache \(the V side would overwrite the K side\)",
        ),
        (
            lambda g: {"k_states": g["k_states"][:, :0], "v_states": g["v_states"][:, :0]},
            ValueError,
            r"k_states must have H_kv >= 1 and D >= 1 \(\[N_tok, H_kv, D\]\), got shape \[3, 0, 128\]",
        ),
        (
            lambda g: {"k_states": g["k_states"][:, :, :0], "v_states": g["v_states"][:, :, :0]},
            ValueError,
            r"k_states must have H_kv >= 1 and D >= 1",
        ),
        (lambda g: {"scale_fmt": "e8m0"}, ValueError, r"scale_fmt must be one of"),
    ],
}
BAD: list[tuple[str, Bad]] = [(op, case) for op, cases in BAD_BY_OP.items() for case in cases]


def _id(op: str, case: Bad) -> str:
    return f"{op}-{case[1].__name__}-{case[2][:40]}"


@pytest.mark.parametrize(("op", "case"), BAD, ids=[_id(*c) for c in BAD])
def test_bad_input_raises(op: str, case: Bad) -> None:
    overrides, exc, pattern = case
    g = _good(op)
    g.update(overrides(g))
    with pytest.raises(exc, match=pattern) as info:
        getattr(cute_moe, op)(**g)
    assert str(info.value).startswith(f"cute_moe.{op}: ")


def test_every_op_has_bad_cases() -> None:
    counts = {op: len(BAD_BY_OP.get(op, [])) for op in OPS}
    assert all(n >= 4 for n in counts.values()), counts


@pytest.mark.parametrize("op", OPS)
def test_good_inputs_pass(op: str) -> None:
    getattr(V, f"validate_{op}")(**_good(op))


@pytest.mark.parametrize("op", OPS)
def test_validation_reads_no_data(op: str) -> None:
    """Validation looks at metadata only: it accepts meta tensors (which have no data)."""
    g = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _good(op).items()}
    getattr(V, f"validate_{op}")(**g)


@pytest.mark.parametrize("op", ["permute_quant", "grouped_gemm_fp8", "fill_kv_cache_fp8"])
def test_mixed_devices_rejected(op: str) -> None:
    g = _good(op)
    last = [k for k, v in g.items() if isinstance(v, torch.Tensor)][-1]
    g[last] = g[last].to("meta")
    with pytest.raises(
        ValueError, match=rf"cute_moe\.{op}: all tensors must be on one device: .* is on cpu, {last} is on meta"
    ):
        getattr(V, f"validate_{op}")(**g)


def test_direct_torch_ops_call_validates() -> None:
    """Validation lives in the op, not only in the functional API."""
    with pytest.raises(ValueError, match=r"cute_moe\.route: top_k must be >= 1"):
        torch.ops.cute_moe.route(torch.randn(2, 8), 0, "softmax")


def test_routing_config_rejects_an_int_scaling_factor_past_the_float_range() -> None:
    """FusedMoE's configuration takes Python numbers (the op's schema takes floats only)."""
    with pytest.raises(ValueError, match=r"cute_moe\.layer: routed_scaling_factor must be finite and > 0"):
        V.check_routing_config("layer", 8, 2, "softmax", 1, 1, 10**400, False)


def test_composable_helpers() -> None:
    t = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"cute_moe\.op: n must be divisible by 4, got 6"):
        V.check_divisible("op", "n", 6, 4)
    with pytest.raises(ValueError, match=r"cute_moe\.op: t must have shape \[4, \*, 2\], got \[4, 6\]"):
        V.check_shape("op", "t", t, (4, None, 2))
    with pytest.raises(TypeError, match=r"cute_moe\.op: flag must be a bool, got int"):
        V.check_bool("op", "flag", 1)
    with pytest.raises(TypeError, match=r"cute_moe\.op: n must be an int, got bool"):
        V.check_int("op", "n", True)
    with pytest.raises(TypeError, match=r"cute_moe\.op: t must be a torch\.Tensor, got list"):
        V.check_tensor("op", "t", [1])
    V.check_aligned_16("op", "t", t[:, 1:], strides=True)  # CPU tensors are not checked
    V.check_last_dim_contiguous("op", "t", t[:, :1])  # a size-1 last dim has any stride
    V.check_choice("op", "layout", "bshd", V.KV_LAYOUTS)


def test_kv_caches_interleaved_in_one_buffer_are_accepted():
    """K and V as the two halves of each block of one buffer ([num_blocks, 2, ...], FlashInfer's
    paged layout): their byte ranges meet but no element is shared.  The op writes what it writes
    into separate caches."""
    g = _good("fill_kv_cache_fp8")
    nb = g["k_cache"].shape[0]
    kv = torch.zeros(nb, 2, *g["k_cache"].shape[1:], dtype=FP8)
    kv_scale = torch.zeros(nb, 2, *g["k_scale_cache"].shape[1:])
    separate = {n: torch.zeros_like(g[n]) for n in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")}
    cute_moe.fill_kv_cache_fp8(**{**g, **separate})
    shared = {"k_cache": kv[:, 0], "v_cache": kv[:, 1], "k_scale_cache": kv_scale[:, 0], "v_scale_cache": kv_scale[:, 1]}
    cute_moe.fill_kv_cache_fp8(**{**g, **shared})
    for name, t in shared.items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == FP8 else t,
                           separate[name].view(torch.uint8) if t.dtype == FP8 else separate[name]), name  # fmt: skip
    assert int(separate["k_cache"].view(torch.uint8).count_nonzero()) > 0  # the op wrote something


def test_fused_moe_ops_check_align_limits_before_any_step(monkeypatch):
    """fused_moe and fused_moe_routed run the check after validation and before their first step."""
    from cute_moe import ops

    class Checked(Exception):
        pass

    steps = []
    monkeypatch.setattr(ops, "call", lambda name, *a: steps.append(name))

    def check(op, x, top_k, e_local):
        raise Checked(op)

    monkeypatch.setattr(ops, "_check_align_limits", check)
    for op in ("fused_moe", "fused_moe_routed"):
        with pytest.raises(Checked, match=op):
            getattr(cute_moe, op)(**_good(op))
    assert steps == []


def test_fused_moe_checks_align_kernel_limits_before_launching():
    """T * k past align's kernel limit is refused by fused_moe / fused_moe_routed before their first
    launch (route's), naming the op.  The device check only needs the tensor's device and shape."""
    from types import SimpleNamespace

    from cute_moe.kernels.align import MAX_ENTRIES

    x = SimpleNamespace(shape=(MAX_ENTRIES // 8 + 1, 7168), device=torch.device("cuda"))
    for op in ("fused_moe", "fused_moe_routed"):
        with pytest.raises(NotImplementedError, match=rf"cute_moe\.{op}: no CUDA kernel for this input \(align's\): "
                                                      rf"T \* k must be <= {MAX_ENTRIES}"):  # fmt: skip
            cute_moe.ops._check_align_limits(op, x, 8, 256)
    cute_moe.ops._check_align_limits("fused_moe", SimpleNamespace(shape=(MAX_ENTRIES // 8, 7168), device=x.device), 8, 256)
    cute_moe.ops._check_align_limits("fused_moe", SimpleNamespace(shape=(10**7, 7168), device=torch.device("cpu")), 8, 256)


def test_share_an_element_against_every_address():
    """``_share_an_element`` on views of one buffer (same shape and strides: exact; other strides:
    never a miss) against the sets of element addresses themselves."""
    from cute_moe.validation import _nested_dims, _share_an_element

    gen = torch.Generator().manual_seed(0)

    def addresses(t: torch.Tensor) -> set[int]:
        idx = torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).reshape(-1, t.dim())
        return set((idx * torch.tensor(t.stride())).sum(dim=1).add(t.storage_offset()).tolist())

    buf = torch.zeros(4096, dtype=FP8)
    interleaved = 0
    for _ in range(1500):
        shape = [int(n) for n in torch.randint(1, 5, (3,), generator=gen)]
        order = torch.randperm(3, generator=gen).tolist()
        pad = [int(p) for p in torch.randint(0, 3, (3,), generator=gen)]
        strides, step = [0, 0, 0], 1
        for d in reversed(order):  # a permuted, padded dense layout: nested strides
            strides[d] = step
            step *= shape[d] + pad[d]
        other = strides if torch.rand(1, generator=gen) < 0.8 else [s + 1 for s in strides]
        a = buf.as_strided(shape, strides, int(torch.randint(0, 200, (1,), generator=gen)))
        b = buf.as_strided(shape, other, int(torch.randint(0, 200, (1,), generator=gen)))
        if _nested_dims(b) is None and b.numel() > 1:
            continue
        addr_a, addr_b = addresses(a), addresses(b)
        shared = bool(addr_a & addr_b)
        got = _share_an_element(a, b)
        if a.stride() == b.stride():
            assert got == shared, (shape, strides, a.storage_offset(), b.storage_offset())
            interleaved += not shared and min(addr_b) <= max(addr_a) and min(addr_a) <= max(addr_b)
        else:
            assert got or not shared
    assert interleaved > 30  # views whose address ranges meet without a shared element were among them
