#!/usr/bin/env bash
# Serving a model on NVIDIA GPUs. MODEL: a Hugging Face folder (config.json + *.safetensors) or a
# .gguf file, e.g. from `hf download Qwen/Qwen3-8B --local-dir ./Qwen3-8B`. GPU users bring their
# own CUDA torch: pip install torch, then pip install kestrel.
#   MODEL=./Qwen3-8B bash examples/serve_gpu.sh
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model folder or .gguf file}
GPUS=${GPUS:-1}  # tensor parallelism: the layers split over GPUs 0..GPUS-1

# --dtype bfloat16: CUDA's default, written out
# --gpu-memory-utilization: the share of each GPU for weights, activations and the KV pool
# -np: sequences decoded together; -c: the context length each may reach
# --host 0.0.0.0 and --api-key: reachable from other machines, so with a key
exec kestrel serve -m "$MODEL" \
    --device cuda --dtype bfloat16 \
    -tp "$GPUS" \
    --gpu-memory-utilization 0.9 \
    -np 64 -c 8192 \
    --host 0.0.0.0 --port 8080 \
    --api-key "${KESTREL_API_KEY:?set KESTREL_API_KEY, the key clients send}" \
    "$@"
