#!/usr/bin/env bash
# The H200 session: the GPU gate (every GPU test, recorded), then `kestrel bench` on the headline
# shapes with the transformers peer in the same run.
# Usage: benchmarks/h200.sh OUTDIR [tests|quick|bench|seeds|structured|multiturn|decode|quantized|full]   (full = tests, bench)
# seeds: the seed families' released shapes (benchmarks/README.md), each with the peer
# structured: batch 64 on llama3-8b through the Engine, free and JSON-schema-constrained
# multiturn: `kestrel serve` on llama3-8b, 64 conversations x 8 turns with and without prefix caching
# decode: single-stream decode (benchmarks/decode_ab.py) of $SHAPES (default: the MoE/MLA shapes
#   and llama3-8b) at each of $PROMPTS prompt tokens (default: 128 4096); a call runs ~1 min each
# quantized: the Llama-3.1-8B shape in bf16, Q4_K_M and FP8 (benchmarks/quantized_speed.py)
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
if [[ $what == seeds ]]; then
  for shape in qwen3-vl-30b-a3b glm-4.7-flash gemma4-26b-a4b gemma4-31b nemotron-h-8b \
      minicpm3-4b nemotron-nas-49b jamba-v0.1; do
    python3 -m kestrel bench --shape "$shape" --peer transformers --no-progress \
      -o "$out/h200-seeds.jsonl" || status=1
  done
fi
if [[ $what == structured ]]; then
  python3 -m kestrel bench engine --shape llama3-8b --num-requests 256 --max-num-seqs 64 \
    --prompt-tokens 512 --output-tokens 256 --temperature 1 --no-progress \
    --json-schema benchmarks/schemas/records.json -o "$out/h200-structured.jsonl" || status=1
fi
if [[ $what == multiturn ]]; then
  python3 -m kestrel serve --shape llama3-8b -np 64 --max-batched-tokens 8192 --port 8400 \
    > "$out/multiturn-serve.log" 2>&1 &
  server=$!
  python3 -m kestrel bench serve --url http://127.0.0.1:8400 --wait 600 --multi-turn \
    --conversations 64 --turns 8 --system-tokens 1000 --turn-tokens 200 --output-tokens 64 \
    --concurrency 64 --compare-no-cache --no-progress -o "$out/h200-multiturn.jsonl" || status=1
  kill $server
fi
if [[ $what == decode ]]; then
  for shape in ${SHAPES:-glm-4.7-flash minicpm3-4b qwen3-vl-30b-a3b gemma4-26b-a4b llama3-8b}; do
    for prompt in ${PROMPTS:-128 4096}; do
      python3 benchmarks/decode_ab.py --shape "$shape" --prompt-tokens "$prompt" \
        -o "$out/h200-decode.jsonl" || status=1
    done
  done
fi
if [[ $what == quantized ]]; then
  python3 benchmarks/quantized_speed.py --out "$out/h200-quantized.jsonl" || status=1
fi
exit $status
