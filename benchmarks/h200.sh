#!/usr/bin/env bash
# The H200 session: GPU tests, then `kestrel bench` with the transformers peer in the same run.
# Usage: benchmarks/h200.sh OUTDIR [tests|quick|full]
set -uo pipefail
out=${1:-benchmarks/results}; what=${2:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
if [[ $what == tests || $what == quick ]]; then
  python3 -m pytest -q tests/test_gpu_kernels.py tests/test_gpu_runner.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [[ $what == quick ]]; then
  python3 -m kestrel bench --shape qwen2.5-0.5b --no-progress -o "$out/quick.jsonl"
  python3 -m kestrel bench --shape llama3-8b --no-progress -o "$out/quick.jsonl"
fi
if [[ $what == full ]]; then
  for shape in llama3-8b qwen2.5-0.5b; do
    python3 -m kestrel bench --shape "$shape" --peer transformers --no-progress -o "$out/h200.jsonl"
  done
fi
