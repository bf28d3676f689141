#!/usr/bin/env bash
# Through the server on the CPU, two trees in one run (A, B, A, B): `kestrel serve` on SmolLM2
# from each tree's src/, then `kestrel bench serve` (this tree's) against it at 8 clients.
# Usage: benchmarks/cpu_serve_ab.sh OUT.jsonl TREE_A TREE_B   (env: N=32 P=64 O=64 C=8)
set -uo pipefail
out=$1; a=$2; b=$3; port=${PORT:-8391}
work=(--num-requests "${N:-32}" --prompt-tokens "${P:-64}" --output-tokens "${O:-64}")
py=${PY:-.venv/bin/python}
for tree in "$a" "$b" "$a" "$b"; do
  PYTHONPATH="$tree/src" "$py" -m kestrel serve -m smollm2 -np "${C:-8}" --port "$port" \
    --log-level warning >/dev/null 2>&1 &
  server=$!
  KESTREL_COMMIT=$(git -C "$tree" rev-parse --short HEAD) PYTHONPATH=src "$py" -m kestrel bench serve \
    --url "http://127.0.0.1:$port" --wait 300 --concurrency "${C:-8}" "${work[@]}" \
    --vocab-size 49152 --no-progress -o "$out" | tail -1 | cut -c1-160
  kill -TERM "$server"; wait "$server"
done
