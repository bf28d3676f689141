#!/usr/bin/env bash
# Disaggregated prefill and decode on two GPUs against one engine, in one call: `kestrel serve`
# on one GPU, then `kestrel serve --disaggregate` (prefill on GPU 0, decode on GPU 1, the KV
# over NCCL), each driven by `kestrel bench serve` at the same concurrency and workload; the
# records (TTFT and TPOT percentiles) go to one JSONL file, the single engine's first. Then the
# KV hand-off time per 1,000 tokens between the two GPUs (benchmarks/kv_handoff.py).
# Usage: benchmarks/disaggregated.sh OUTDIR   (env: SHAPE=llama3-8b C=64 N=256 P=2048 O=256)
set -uo pipefail
py=${PY:-python3}
out=${1:-benchmarks/results}; shape=${SHAPE:-llama3-8b}; c=${C:-64}; n=${N:-256}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export KESTREL_COMMIT=${KESTREL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
work=(--num-requests "$n" --prompt-tokens "${P:-2048}" --output-tokens "${O:-256}")
engine=(--shape "$shape" --max-batched-tokens "${T:-8192}" -np "$c" --max-queue-depth "$n")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
port=${PORT:-8321}
records="$out/disaggregated-$shape-$KESTREL_COMMIT.jsonl"

serve_and_bench() {  # $1: label; the rest: the server's flags
  local label=$1; shift
  "$py" -m kestrel serve "${engine[@]}" "$@" --port "$port" --log-level warning \
    >"$out/server-$label.log" 2>&1 &
  local server=$!
  echo "{\"run\": \"$label\", \"flags\": \"$*\"}" >>"$records"
  "$py" -m kestrel bench serve --url "http://127.0.0.1:$port" --wait 600 --concurrency "$c" \
    "${work[@]}" --vocab-size "${V:-128256}" --no-progress -o "$records"
  local status=$?
  kill -TERM "$server"; wait "$server"
  tail -3 "$out/server-$label.log"
  return $status
}

serve_and_bench one-engine --device cuda:0 || exit 1
serve_and_bench disaggregated --disaggregate --prefill-device cuda:0 --decode-device cuda:1 \
  || exit 1
"$py" benchmarks/kv_handoff.py --shape "$shape" --prefill-device cuda:0 --decode-device cuda:1 \
  --tokens 1024 4096 --out "$records"
