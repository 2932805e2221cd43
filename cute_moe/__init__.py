"""cute_moe: Mixture-of-Experts FP8 kernels (CUTLASS CuTe DSL) as ``torch.ops.cute_moe.*``.

Importing the package registers the custom ops; it does not import ``cutlass`` and
does not initialise CUDA (DSL kernels are imported on first CUDA use), so it works
on a machine with no GPU, where every op runs its pure-PyTorch reference.
``cute_moe.FusedMoE`` (``cute_moe/layer.py``) is a whole MoE layer as a ``torch.nn.Module``.
"""

from cute_moe import functional, ops  # noqa: F401  (importing ops registers torch.ops.cute_moe.*)
from cute_moe.functional import (
    align,
    fill_kv_cache_fp8,
    finalize,
    fused_moe,
    fused_moe_routed,
    grouped_gemm_fp8,
    grouped_gemm_fp8_swiglu,
    moe_reduce,
    permute,
    permute_quant,
    quant_fp8,
    route,
    silu_mul_quant,
)
from cute_moe.layer import FusedMoE
from cute_moe.reference import FP8_DTYPE, FP8_MAX, m_cap

__version__ = "0.1.0"

__all__ = ["FP8_DTYPE", "FP8_MAX", "FusedMoE", "__version__", "m_cap", *functional.__all__]
