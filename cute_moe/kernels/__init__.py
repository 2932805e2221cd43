"""CuTe DSL kernels, one module per op family.

Each module imports ``cutlass`` at import time, so it is imported lazily: by an
op's CUDA implementation on first use, or by ``python -m cute_moe.inspect``.
``KERNEL_MODULES`` maps an op name to the module holding its kernel(s); every
such module exposes ``inspect_variants(arch) -> [(name, compiled_fn, dynamic_smem_bytes)]``.
"""

KERNEL_MODULES = {
    "quant_fp8": "cute_moe.kernels.quant_fp8",
    "fill_kv_cache_fp8": "cute_moe.kernels.fill_kv_cache_fp8",
    "finalize": "cute_moe.kernels.finalize",
    "permute_quant": "cute_moe.kernels.permute_quant",
    "permute": "cute_moe.kernels.permute_quant",
    "silu_mul_quant": "cute_moe.kernels.silu_mul_quant",
    "moe_reduce": "cute_moe.kernels.moe_reduce",
    "route": "cute_moe.kernels.route",
    "align": "cute_moe.kernels.align",
    "grouped_gemm_fp8": "cute_moe.kernels.grouped_gemm",
    "grouped_gemm_fp8_swiglu": "cute_moe.kernels.grouped_gemm_swiglu",
}
