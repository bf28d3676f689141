#!/usr/bin/env bash
# Single stream against the card and the compiled peer, in one GPU call: the card's measured copy
# bandwidth and bf16 matmul rate (OUTDIR/card.jsonl), then per shape `kestrel bench latency` with
# `--peer gpt-fast` (gpt-fast compiled on the shape's nearest model, in the same run), appended to
# OUTDIR/roofline-peers.jsonl. Needs gpt-fast's files in benchmarks/.peers/gpt-fast (`make gpt-fast`).
# Usage: benchmarks/roofline_peers.sh OUTDIR [SHAPE...]
#   default shapes: llama3-8b and the MoE/MLA ones; PEER_LIMIT (s, default 240) stops a peer that
#   compiles longer; EXTRA: more `kestrel bench` flags (e.g. EXTRA='--peer transformers')
set -uo pipefail
out=${1:?usage: benchmarks/roofline_peers.sh OUTDIR [SHAPE...]}; shift
shapes=("$@")
[[ ${#shapes[@]} -gt 0 ]] || shapes=(llama3-8b qwen3-vl-30b-a3b gemma4-26b-a4b glm-4.7-flash minicpm3-4b)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
$python benchmarks/card.py --device "${DEVICE:-cuda}" -o "$out/card.jsonl" || exit 1
status=0
for shape in "${shapes[@]}"; do
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  $python -m kestrel bench latency --shape "$shape" --peer gpt-fast --no-progress \
    --peer-time-limit "${PEER_LIMIT:-240}" ${EXTRA:-} -o "$out/roofline-peers.jsonl" || status=1
done
$python benchmarks/peer_table.py "$out/roofline-peers.jsonl" || status=1
exit $status
