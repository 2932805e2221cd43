#!/usr/bin/env bash
# compute-sanitizer over small GPU test cases: every kernel, and the sm90 GEMM's compile variants
# (with and without expert counts, pairs along N and M, store-wait and store-behind epilogues,
# 128- and 256-wide tiles):
#   DSL=$(bash .device/use-cute-dsl.sh) || exit 3; export PYTHONPATH=$PWD:$DSL
#   bash bench/sanitize.sh TOOL [pytest node ids...]      (from the repository root)
# TOOL: memcheck, racecheck, synccheck or initcheck.  Without node ids, the cases below; memcheck
# takes ~2 minutes on the H200, the other tools several times that: give them a few node ids.
# Each case also checks its output against the reference.  $OUT/<tool>.log holds the tool's
# report, $OUT/<tool>.txt pytest's output.
#
# What sessions 17 and 20 saw (bench/NOTES.md), on the cases named there:
# - memcheck: 0 errors over this list, less the two E32_N256_K1536_empty cases of pairs_n-store_behind
#   and pairs_m-store_wait, added after the run (session 17); the four store_wait-tile256 cases,
#   added in session 20, and the two store_behind-tile256 cases (session 22), 0 errors on their
#   own.  Not run under it yet: the two 128-wide SwiGLU pair-split cases (session 29) and the
#   permute (FP8 in) case (session 33).
# - synccheck: 0 errors on the GEMM (counts, pairs along M, store-behind) and permute_quant's
#   two launches; the other kernels were not run under it.
# - racecheck, on the GEMM and permute_quant only: write-after-read reports on the sm90 GEMM's
#   scale slots (the math warps' LDS, the scale warp's next cp.async into the same stage).  Only
#   lanes 0 and 1 of a math warp arrive on the stage's empty barrier; the tool does not count the
#   other lanes' earlier reads as ordered before that arrive.  The warp is converged and its reads
#   come before the arrive in one instruction stream; a bar.warp.sync before the arrive compiles
#   to a NOP there and leaves the reports as they are.  These reports make racecheck exit 9: read
#   the log, a report on another kernel or address is new.
# - The 128-wide SwiGLU kernel's two cases (session 29: its cluster pair exchanges row amaxes by
#   st.async into each other's shared memory), session 30 on an H100: synccheck 0 errors (both
#   passed, 17 s); racecheck did not finish the first case in 90 s.  Until then it printed 50 WAR
#   reports, all one write (thread 32: the scale warp) against two reads of math-warp thread 131,
#   the scale-slot pattern above; none on the exchange, which the unfinished run does not clear.
#   Give racecheck several minutes and one node id.
# - initcheck: the tool does not see TMA stores, so it flags reads of every output a kernel stores
#   by TMA (the GEMM's C), and it exits 9.  With PYTORCH_NO_CUDA_MEMORY_CACHING the tests' NaN
#   poisoning does not reach the outputs either: this tool checks the other kernels' reads only.
set -uo pipefail
tool="${1:-}"
case "$tool" in
  memcheck|racecheck|synccheck|initcheck) shift ;;
  *) echo "usage: bash bench/sanitize.sh memcheck|racecheck|synccheck|initcheck [pytest node ids...]" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
G=tests/test_gpu_grouped_gemm.py
cases=(
  "$G::test_grouped_gemm_fp8[E32_N256_K1536_empty-pairs_n-store_wait-tile128]"
  "$G::test_grouped_gemm_fp8[E32_N256_K1536_empty-pairs_n-store_behind-tile128]"
  "$G::test_grouped_gemm_fp8[E32_N256_K1536_empty-pairs_m-store_wait-tile128]"
  "$G::test_grouped_gemm_fp8[E32_N512_K4096_ragged-pairs_m-store_behind-tile128]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_n-store_wait-tile128-E8_N256_K1536_decode]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_n-store_wait-tile128-dsv3_w2_E256_decode]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_m-store_wait-tile128-E8_N384_K384_ragged]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_m-store_behind-tile128-E10_N2112_K512_sparse_edge]"
  "$G::test_grouped_gemm_fp8_misaligned_segments_give_nan_with_counts[pairs_m-store_wait-tile128]"
  "$G::test_grouped_gemm_fp8[E1_N2112_K7168-pairs_n-store_wait-tile256]"
  "$G::test_grouped_gemm_fp8[E8_N384_K384_ragged-pairs_m-store_wait-tile256]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_n-store_wait-tile256-dsv3_w13_E8_ragged]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_m-store_wait-tile256-E10_N2112_K512_sparse_edge]"
  "$G::test_grouped_gemm_fp8_with_expert_counts[pairs_n-store_behind-tile256-E10_N2112_K512_sparse_edge]"
  "$G::test_grouped_gemm_fp8[E8_N384_K384_ragged-pairs_m-store_behind-tile256]"
  "tests/test_gpu_grouped_gemm_swiglu.py::test_fused_equals_the_two_kernels[E64_rows384_I256_K4096_pairs_m-True-None-counts]"
  "tests/test_gpu_grouped_gemm_swiglu.py::test_fused_equals_the_two_kernels[E64_rows1024_I384_K4096_pairs_n_odd-False-ue8m0-no_counts]"
  "tests/test_gpu_grouped_gemm_swiglu.py::test_fused_equals_the_two_kernels[E64_rows1024_I384_K4096_pairs_n_odd-True-None-counts]"
  "tests/test_gpu_grouped_gemm_swiglu.py::test_pair_split_equals_the_two_kernels[E16_rows300_I384_K4096_dense-True-None-counts]"
  "tests/test_gpu_grouped_gemm_swiglu.py::test_pair_split_equals_the_two_kernels[E32_rows90_I128_K1024_empty-False-ue8m0-no_counts]"
  "tests/test_gpu_permute_quant.py::test_permute_quant_token_scales_in_two_launches[ragged-True]"
  "tests/test_gpu_permute_quant.py::test_permute_quant_two_launches_through_the_launch_function"
  "tests/test_gpu_permute_quant.py::test_permute_quant_h_not_a_multiple_of_1024"
  "tests/test_gpu_permute_quant.py::test_permute_quant_token_major_expert_parallel"
  "tests/test_gpu_permute_quant.py::test_permute[False-2048-7-ragged]"
  "tests/test_gpu_silu_mul_quant.py::test_silu_counts_skip_padding"
  "tests/test_gpu_silu_mul_quant.py::test_silu_no_rows_and_strided_h"
  "tests/test_gpu_finalize.py::test_finalize_large_topk"
  "tests/test_gpu_finalize.py::test_moe_reduce_large_topk"
  "tests/test_gpu_route.py::test_route_odd_expert_counts"
  "tests/test_gpu_route.py::test_route_wide_topk"
  "tests/test_gpu_align.py::test_align_expert_parallel_shards"
  "tests/test_gpu_quant_fp8.py::test_quant_fp8_strided_rows"
  "tests/test_gpu_fill_kv_cache_fp8.py::test_unwritable_tokens_are_skipped"
  "tests/test_gpu_fused_moe.py::test_fused_moe_matches_reference[qwen3_30b_a3b-5]"
  "tests/test_gpu_fused_moe.py::test_fused_moe_gate_second_and_ue8m0_scales"
)
if [ "$#" -gt 0 ]; then cases=("$@"); fi
extra=()
case "$tool" in
  racecheck) extra=(--racecheck-report hazard) ;;
  initcheck) export PYTORCH_NO_CUDA_MEMORY_CACHING=1 ;;  # fresh allocations, so unwritten memory shows
esac
rm -f "$OUT/$tool.log"
# --report-api-errors no: the driver's entry-point probing at start-up is not a kernel error.
"$CS" --tool "$tool" "${extra[@]}" --report-api-errors no --error-exitcode 9 --print-limit 50 \
  --log-file "$OUT/$tool.log" python3 -m pytest -q -m gpu -p no:cacheprovider "${cases[@]}" > "$OUT/$tool.txt" 2>&1
rc=$?
tail -3 "$OUT/$tool.txt"
grep -sE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1
exit "$rc"
