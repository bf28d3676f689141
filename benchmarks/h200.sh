#!/usr/bin/env bash
# The H200 session: the GPU gate (every GPU test, recorded), then `kestrel bench` on the headline
# shapes with the transformers peer in the same run.
# Usage: benchmarks/h200.sh OUTDIR [tests|quick|bench|full]   (full = tests, then bench)
set -uo pipefail
out=${1:-benchmarks/results}; what=${2:-full}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
status=0
if [[ $what == tests || $what == full ]]; then
  python3 benchmarks/gpu_gate.py -o "$out/gpu-tests.json" 2>&1 | tee "$out/gpu_tests.log" | tail -25
  status=${PIPESTATUS[0]}
fi
if [[ $what == quick ]]; then
  for shape in qwen2.5-0.5b llama3-8b; do
    python3 -m kestrel bench --shape "$shape" --no-progress -o "$out/quick.jsonl" || status=1
  done
fi
if [[ $what == bench || $what == full ]]; then
  for shape in llama3-8b qwen2.5-0.5b; do
    python3 -m kestrel bench --shape "$shape" --peer transformers --no-progress \
      -o "$out/h200.jsonl" || status=1
  done
fi
exit $status
