#!/usr/bin/env bash
# The FP8 KV cache on one GPU, in one call: its GPU tests, then offline throughput of 256 requests
# of 512 + 256 tokens with the model-dtype pool and the FP8 pool, alternating per shape, so each
# ratio compares two runs of one machine and one call.
# Usage: benchmarks/fp8_kv.sh OUTDIR [SHAPES...]   (default: llama3-8b qwen3-vl-30b-a3b gemma4-26b-a4b)
set -uo pipefail
out=$1; shift
shapes=${*:-llama3-8b qwen3-vl-30b-a3b gemma4-26b-a4b}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_runner.py \
  tests/test_gpu_entry_points.py -k "fp8 or fused" 2>&1 | tail -5 || status=1
for shape in $shapes; do
  for dtype in auto fp8; do
    python3 -m kestrel bench throughput --shape "$shape" --kv-cache-dtype "$dtype" \
      --no-progress -o "$out/fp8-kv.jsonl" 2>&1 | grep -v Warning | tail -2 || status=1
  done
done
exit $status
