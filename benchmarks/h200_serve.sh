#!/usr/bin/env bash
# Through the HTTP server vs offline, in one call on the H200: `kestrel bench throughput`
# at the same concurrency, then `kestrel serve` on the same random-weight shape and
# `kestrel bench serve` against it; between them `kestrel bench engine` (offline through the
# Engine). All drive 256 requests of 512 prompt + 256 output tokens.
# Usage: benchmarks/h200_serve.sh OUTDIR   (env: SHAPE=llama3-8b C=64 N=256 DEVICE=auto)
set -uo pipefail
py=${PY:-python3}
out=${1:-benchmarks/results}; shape=${SHAPE:-llama3-8b}; c=${C:-64}; n=${N:-256}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
work=(--num-requests "$n" --prompt-tokens "${P:-512}" --output-tokens "${O:-256}")
engine=(--shape "$shape" --device "${DEVICE:-auto}" --max-batched-tokens "${T:-8192}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
"$py" -m kestrel bench throughput "${engine[@]}" --max-num-seqs "$c" "${work[@]}" \
  --no-progress -o "$out/serve.jsonl" || exit 1
# the same through the Engine (detokenizer, stop checks), as the server's engine thread runs it
"$py" -m kestrel bench engine "${engine[@]}" --max-num-seqs "$c" "${work[@]}" \
  --no-progress -o "$out/serve.jsonl" || exit 1
port=${PORT:-8321}
"$py" -m kestrel serve "${engine[@]}" -np "$c" --max-queue-depth "$n" --port "$port" \
  --log-level warning >"$out/server.log" 2>&1 &
server=$!
"$py" -m kestrel bench serve --url "http://127.0.0.1:$port" --wait 300 --concurrency "$c" \
  "${work[@]}" --vocab-size "${V:-128256}" --no-progress -o "$out/serve.jsonl"
status=$?
kill -TERM "$server"; wait "$server"
tail -5 "$out/server.log"
exit $status
