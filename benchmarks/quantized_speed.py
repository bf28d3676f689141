"""Llama-3.1-8B-shaped quantized checkpoints on CUDA against the bf16 `--shape llama3-8b`, all in
one run: a Q4_K_M GGUF with its blocks kept packed (GPU memory of the loaded weights against the
file, and single-stream decode) and an FP8 checkpoint with 128 x 128 block scales (single stream
and 256 x (512+256) throughput), through `kestrel bench`.

The checkpoints hold random valid weights, written one tensor at a time into a temporary folder
(the Q4_K_M by benchmarks/quantized_memory.py's writer, llama.cpp's type mix; the FP8 by
tests/quant_writer.py), measured, then deleted. Targets (the quantized-weights issue): Q4_K_M
`torch.cuda.memory_allocated` at most 1.1x the file and decode at least 2x bf16; FP8 single
stream at least 1.6x bf16 and throughput at least 1.2x.

`--formats moe_q4_k_m` writes a Qwen3-30B-A3B-shaped Q4_K_M MoE (benchmarks/quantized_memory.py's
`moe-30b-a3b`: 128 experts, 8 active) and decodes it twice, its blocks kept packed and dequantized
to bf16 at load, so the packed experts' speed is measured against the same model in bf16.
`--formats moe_fp8` writes GLM-4.7-Flash's shape (`--shape glm-4.7-flash`: MLA, 64 experts, 4
active) as an FP8 checkpoint with 128 x 128 block scales and experts stored one tensor per expert
(tests/quant_writer.py's `write_random_shape`), and measures it against that bf16 shape.

    python benchmarks/quantized_speed.py --out benchmarks/results/h200-quantized-<commit>.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.quantized_memory import write_file  # noqa: E402
from tests.quant_writer import write_random_llama, write_random_shape  # noqa: E402


def weights_memory(path: Path) -> dict:
    """GPU bytes held after loading the GGUF packed (no KV pool yet)."""
    import torch

    from kestrel.weights.loader import load_model, resolve

    start = time.perf_counter()
    model = load_model(resolve(str(path)), torch.bfloat16, torch.device("cuda"), False, True)
    allocated = torch.cuda.memory_allocated()
    del model
    torch.cuda.empty_cache()
    file_bytes = path.stat().st_size
    return {
        "kind": "memory",
        "file_bytes": file_bytes,
        "allocated_bytes": allocated,
        "allocated_over_file": round(allocated / file_bytes, 3),
        "load_s": round(time.perf_counter() - start, 1),
        "target": "allocated <= 1.1 x file",
    }


def bench(mode: str, model_args: list[str], out: Path, tokens: int) -> None:
    """`kestrel bench MODE` in its own process (each model gets the whole GPU)."""
    command = [sys.executable, "-m", "kestrel", "bench", mode, *model_args, "--no-progress"]
    command += ["--latency-output-tokens", str(tokens), "-o", str(out)]
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))


def timed_write(write, path: Path) -> None:
    start = time.perf_counter()
    write(path)
    print(f"wrote {path.name} in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    parser.add_argument(
        "--formats",
        nargs="+",
        default=["q4_k_m", "fp8"],
        choices=["q4_k_m", "fp8", "moe_q4_k_m", "moe_fp8"],
    )
    parser.add_argument("--output-tokens", type=int, default=256, help="single stream")
    parser.add_argument("--no-throughput", action="store_true", help="single streams only")
    parser.add_argument("--no-single-stream", action="store_true", help="FP8 throughput only")
    args = parser.parse_args()
    out = Path(args.out)
    bf16 = ["--shape", "llama3-8b"]
    llama = {"q4_k_m", "fp8"} & set(args.formats)  # measured against the bf16 llama3-8b shape
    if llama and not args.no_single_stream:
        bench("latency", bf16, out, args.output_tokens)
    throughput = "fp8" in args.formats and not args.no_throughput
    if throughput:
        bench("throughput", bf16, out, args.output_tokens)
    if "q4_k_m" in args.formats:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "llama-3.1-8b-Q4_K_M.gguf"
            timed_write(lambda p: write_file(p, "llama-3.1-8b"), path)
            record = dict(weights_memory(path), checkpoint="llama-3.1-8b Q4_K_M")
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)
            bench(
                "latency", ["-m", str(path), "--quantized-weights", "keep"], out, args.output_tokens
            )
    if "moe_q4_k_m" in args.formats:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "moe-30b-a3b-Q4_K_M.gguf"
            timed_write(lambda p: write_file(p, "moe-30b-a3b"), path)
            for weights in ("dequantize", "keep"):
                model = ["-m", str(path), "--quantized-weights", weights]
                bench("latency", model, out, args.output_tokens)
    if "moe_fp8" in args.formats:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "glm-4.7-flash-fp8"
            timed_write(lambda p: write_random_shape(p, "fp8", "glm-4.7-flash"), path)
            for model in (["--shape", "glm-4.7-flash"], ["-m", str(path)]):
                bench("latency", model, out, args.output_tokens)
                if not args.no_throughput:
                    bench("throughput", model, out, args.output_tokens)
    if "fp8" in args.formats:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "llama-3.1-8b-fp8"
            timed_write(lambda p: write_random_llama(p, "fp8"), path)
            if not args.no_single_stream:
                bench("latency", ["-m", str(path)], out, args.output_tokens)
            if throughput:
                bench("throughput", ["-m", str(path)], out, args.output_tokens)


if __name__ == "__main__":
    main()
