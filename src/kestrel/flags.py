"""The model and engine flags that generate, run, serve and bench share (their dests are
kestrel.config's names, so `config_from_args` reads them)."""

import argparse

from kestrel.config import default_of
from kestrel.weights.embedded import DEFAULT_MODEL

MODEL_HELP = (
    "alias, .gguf file (a split one's first shard), HF folder, or Hugging Face repo org/repo "
    "(org/repo:Q4_K_M picks a GGUF quant; from the local HF cache, downloaded when missing)"
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by generate, run, serve and bench."""
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument(
        "--dtype",
        default=default_of("dtype"),
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16",
    )
    p.add_argument("--device", default=default_of("device"), help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--quantized-weights",
        choices=["auto", "keep", "dequantize"],
        default=default_of("quantized_weights"),
        help="GGUF blocks: keep them packed (less memory; on CUDA, decode reads 4-8 bits a "
        "weight), dequantize them at load, or auto: keep them when the model would not fit "
        "dequantized in half the device's memory",
    )
    p.add_argument(
        "--max-kv-size", type=int, default=0, help="per-sequence KV bound in tokens (0 = off)"
    )
    p.add_argument(
        "--keep", type=int, default=default_of("keep"), help="sink tokens kept when trimming"
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="recompute every prompt instead of reusing the KV of prefixes seen before",
    )
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context length (0 = the model's)")
    p.add_argument(
        "--prefill-chunk-size",
        "-b",
        "--batch-size",
        dest="prefill_chunk_size",
        type=int,
        default=default_of("prefill_chunk_size"),
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (default: one prefill chunk plus one per running sequence; bench: 8192 on CUDA)",
    )
    from kestrel.weights.shapes import SHAPES

    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="random weights of a named shape instead of -m (benchmarks)",
    )
    add_speculative_args(p)
    add_lora_args(p)
    parallel = p.add_argument_group("parallel")
    parallel.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=_positive,
        default=default_of("tensor_parallel_size"),
        help="split every layer over this many processes, one device each (CUDA: GPUs 0..N-1)",
    )
    parallel.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=_positive,
        default=default_of("pipeline_parallel_size"),
        help="split the layers into this many stages, one process and device each",
    )
    parallel.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="with -tp: each rank holds whole experts (E / N of them) instead of a slice of each",
    )
    parallel.add_argument(
        "--pp-layers",
        default=None,
        help="each stage's layers, e.g. 0-15,16-31 (default: an even split)",
    )
    parallel.add_argument(
        "--pp-microbatch-tokens",
        type=_positive,
        default=None,
        help="with -pp: cut a step of at least twice this many tokens into micro-batches (up to "
        "2 per stage) that the stages work on at once (default: 128 on CUDA, 16 on the CPU)",
    )
    gpu = p.add_argument_group("CUDA")
    gpu.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=default_of("gpu_memory_utilization"),
        help="fraction of the GPU's memory for weights, activations and the KV pool",
    )
    gpu.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode steps eagerly",
    )
    gpu.add_argument(
        "--block-size",
        type=int,
        default=default_of("block_size"),
        help="KV pool block size in tokens",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3"],
        default=default_of("kv_cache_dtype"),
        help="dtype of the KV cache pool: auto (the model's) or fp8 (e4m3 with a scale per layer "
        "and KV head from the first prompt chunk: twice the tokens in the same memory)",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=_gib,
        default=default_of("kv_offloading_size"),
        metavar="GIB",
        help="GiB of host memory (pinned on CUDA) that keeps the prefix-cache blocks the KV pool "
        "evicts and copies them back on a hit (vLLM's flag; 0 = off)",
    )
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=default_of("mamba_ssm_cache_dtype"),
        help="dtype of the hybrid models' SSM state (computed in float32 either way)",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive.__name__ = "positive integer"


def _gib(text: str) -> float:
    """A size in GiB, >= 0 (argparse names the flag when it raises)."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value


_gib.__name__ = "size in GiB (>= 0)"


def _count(text: str) -> int:
    """A token count in [1, 64] (argparse names the flag when it raises)."""
    value = int(text)
    if not 1 <= value <= 64:
        raise ValueError(text)
    return value


_count.__name__ = "integer in [1, 64]"  # argparse's message: "invalid integer in [1, 64] value"


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    from kestrel.config import SPECULATIVE_METHODS

    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="propose tokens and verify them in one forward (ngram: prompt lookup; draft: a "
        "smaller model with the same tokenizer, --draft-model; mtp: the checkpoint's own "
        "multi-token-prediction layer, EXAONE-MoE and GLM-4.x-Flash); output unchanged",
    )
    spec.add_argument(
        "--draft-model",
        default=None,
        help="--speculative draft's model: an alias, a .gguf file, a folder or a Hugging Face "
        "repo (with --shape: a shape name)",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=_count,
        default=default_of("num_speculative_tokens"),
        help="most tokens proposed per step",
    )
    spec.add_argument(
        "--ngram-min", type=_count, default=default_of("ngram_min"), help="shortest n-gram matched"
    )
    spec.add_argument(
        "--ngram-max",
        type=_count,
        default=default_of("ngram_max"),
        help="longest n-gram matched (first)",
    )


def add_lora_args(p: argparse.ArgumentParser) -> None:
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (loaded at runtime by POST /v1/load_lora_adapter; on with "
        "--lora-modules)",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT adapter folders to load at start; a request picks one by its `model` field",
    )
    lora.add_argument(
        "--max-loras",
        type=_positive,
        default=default_of("max_loras"),
        help="most adapters in one batch (device slots)",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=_positive,
        default=default_of("max_lora_rank"),
        help="the largest adapter rank accepted",
    )
