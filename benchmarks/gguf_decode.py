"""A Llama-3.1-8B-shaped Q4_K_M GGUF on CUDA with its blocks kept packed, against the bf16
`--shape llama3-8b` in the same run: GPU memory of the loaded weights against the file's size,
and single-stream decode speed of both (`kestrel bench latency`).

Writes the GGUF of random valid blocks (benchmarks/quantized_memory.py's writer, llama.cpp's
Q4_K_M mix) into a temporary folder, measures, and deletes it. Targets (the quantized-weights
issue): `torch.cuda.memory_allocated` after loading at most 1.1x the file; decode at least 2x
the bf16 figure.

    python benchmarks/gguf_decode.py --out benchmarks/results/h200-gguf-decode-<commit>.jsonl
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


def weights_memory(path: Path) -> dict:
    """GPU bytes held after loading the file packed (no KV pool yet)."""
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
    }


def latency(model_args: list[str], out: Path, output_tokens: int) -> None:
    """`kestrel bench latency` in its own process (each model gets a fresh GPU)."""
    command = [sys.executable, "-m", "kestrel", "bench", "latency", *model_args]
    command += ["--latency-output-tokens", str(output_tokens), "--no-progress", "-o", str(out)]
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    subprocess.run(command, check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines are appended here")
    parser.add_argument("--shape", default="llama-3.1-8b", help="quantized_memory.py's shapes")
    parser.add_argument("--bf16-shape", default="llama3-8b", help="kestrel's --shape name")
    parser.add_argument("--output-tokens", type=int, default=256)
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{args.shape}-Q4_K_M.gguf"
        start = time.perf_counter()
        write_file(path, args.shape)
        print(f"wrote {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
        record = weights_memory(path)
        record.update(shape=args.shape, target="allocated <= 1.1 x file")
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        latency(["-m", str(path), "--quantized-weights", "keep"], out, args.output_tokens)
    latency(["--shape", args.bf16_shape], out, args.output_tokens)


if __name__ == "__main__":
    main()
