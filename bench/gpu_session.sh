#!/usr/bin/env bash
# One device call: environment facts, the GPU tests, then the benchmarks named.
#   DSL=$(bash .device/use-cute-dsl.sh) || exit 3; export PYTHONPATH=$PWD:$DSL
#   bash bench/gpu_session.sh "tests/test_gpu_quant_fp8.py" bench/bench_quant_fp8.py
#   SUITE_BUDGET_S=300 bash bench/gpu_session.sh "--ids left.txt"   # the rest of a cut-off suite
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tests="${1:-tests}"; shift || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', cutlass.__version__ if hasattr(cutlass, '__version__') else '?')"
# Stops after the test that ends past the budget; $OUT/left.txt lists what a next call runs with
# --ids (bench/gpu_suite.py), once copied from the returned files into the repository root.
python3 bench/gpu_suite.py --budget-s "${SUITE_BUDGET_S:-420}" $tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
for b in "$@"; do python3 "$b" 2>&1 | tee "$OUT/$(basename "$b" .py).log"; done
