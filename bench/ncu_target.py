"""One warm call of a kernel for Nsight Compute to profile (the call before it compiles and warms up).

    ncu --clock-control none --kernel-name regex:kernel_cutlass -c 1 --launch-skip 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 bench/ncu_target.py kv_llama_prefill

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python3 bench/ncu_target.py layer_t1          # every kernel of one warm layer call
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cute_moe  # noqa: E402
from tests.kv_cases import make_kv_case  # noqa: E402


def _kv(heads, dim, with_v):
    case = make_kv_case([8192] * 8, [0] * 8, heads, dim, with_v=with_v)
    return lambda: cute_moe.fill_kv_cache_fp8(*case.args())


def _quant():
    x = torch.randn(16384, 7168, device="cuda", dtype=torch.bfloat16)
    return lambda: cute_moe.quant_fp8(x)


def _gemm(n, k, groups=4, rows=8192):
    from tests.test_gpu_grouped_gemm import make_problem, routing_from_counts

    p = make_problem(groups, n, k, routing_from_counts([rows] * groups, m_cap=groups * rows), seed=1)
    return lambda: torch.ops.cute_moe.grouped_gemm_fp8(*p.args())


def _gemm_decode(n, k, tokens=1):
    """DeepSeek-V3 decode routing (top-8 of 256 experts) with align's counts, as fused_moe calls it."""
    from bench_grouped_gemm import Shape, make_problem

    p = make_problem(Shape("decode", "decode", 256, n, k, tokens=tokens))
    args = (p.a, p.a_scale, p.b, p.b_scale, p.offsets, p.expert_counts)
    return lambda: torch.ops.cute_moe.grouped_gemm_fp8(*args)


def _layer(tokens=1):
    """The full-size DeepSeek-V3 fused_moe (random FP8 weights): profile with --launch-skip 0 and no
    kernel filter after the first call to list every kernel of one layer call."""
    from cute_moe.__main__ import FULL_E, FULL_H, FULL_I, FULL_K, FULL_N_GROUP, FULL_SCALING, FULL_TOPK_GROUP
    from cute_moe.testing import random_fp8_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w13_scale = random_fp8_experts(FULL_E, 2 * FULL_I, FULL_H, g)
    w2, w2_scale = random_fp8_experts(FULL_E, FULL_H, FULL_I, g)
    bias = 0.1 * torch.randn(FULL_E, generator=g, device="cuda")
    x = torch.randn(tokens, FULL_H, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, FULL_E, generator=g, device="cuda")
    return lambda: torch.ops.cute_moe.fused_moe(x, logits, w13, w13_scale, w2, w2_scale, FULL_K, "deepseek_v3", bias,
                                                FULL_N_GROUP, FULL_TOPK_GROUP, FULL_SCALING)  # fmt: skip


def _stream(kind: str, nbytes: int = 1 << 30):
    """HBM reference streams: ``write`` (a fill kernel, write only) and ``read`` (a sum, read only)."""
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    return (lambda: buf.fill_(7)) if kind == "write" else (lambda: buf.sum(dtype=torch.int64))


def _uniform_routing(t: int, e: int, k: int):
    """align's (offsets, row_to_token, token_to_row, counts) for uniform top-k routing of t tokens."""
    from cute_moe.reference import align_ref

    ids = torch.rand(t, e, device="cuda").argsort(dim=1)[:, :k].to(torch.int32)
    return align_ref(ids, e, 128)


def _permute_quant(token_major: bool, t: int = 16384, h: int = 7168, e: int = 256, k: int = 8, zero_padding=True):
    offsets, row_to_token, token_to_row, _ = _uniform_routing(t, e, k)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    t2r = token_to_row if token_major else None
    return lambda: cute_moe.permute_quant(x, row_to_token, offsets, token_to_row=t2r, zero_padding=zero_padding)


def _silu(t: int = 16384, e: int = 256, k: int = 8, inter: int = 2048):
    """silu_mul_quant as fused_moe calls it (align's counts), DeepSeek-V3 uniform top-8."""
    offsets, row_to_token, _, counts = _uniform_routing(t, e, k)
    h = torch.randn(row_to_token.shape[0], 2 * inter, device="cuda", dtype=torch.bfloat16)
    counts = counts.to(torch.int32)
    return lambda: cute_moe.silu_mul_quant(h, offsets, expert_counts=counts)


TARGETS = {
    "permute_quant_tokens": lambda: _permute_quant(True),
    "permute_quant_rows": lambda: _permute_quant(False),
    "permute_quant_fused": lambda: _permute_quant(True, zero_padding=False),
    "hbm_write_1g": lambda: _stream("write"),
    "hbm_read_1g": lambda: _stream("read"),
    "silu_16384": _silu,
    "gemm_w13": lambda: _gemm(4096, 7168),
    "gemm_w2": lambda: _gemm(7168, 2048),
    "gemm_w13_t1": lambda: _gemm_decode(4096, 7168),
    "gemm_w2_t1": lambda: _gemm_decode(7168, 2048),
    "gemm_w13_t8192": lambda: _gemm_decode(4096, 7168, 8192),
    "gemm_w13_g256": lambda: _gemm(4096, 7168, 256, 256),
    "layer_t1": _layer,
    "layer_t4096": lambda: _layer(4096),
    "layer_t8192": lambda: _layer(8192),
    "kv_llama_prefill": lambda: _kv(8, 128, True),
    "kv_mla_prefill": lambda: _kv(1, 512, False),
    "quant_16384": _quant,
}

if __name__ == "__main__":
    fn = TARGETS[sys.argv[1]]()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()  # with `ncu --profile-from-start off`: the warm call only
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
