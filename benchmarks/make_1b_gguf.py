"""The CPU benchmark's 1B-class file: a Llama-3.2-1B-shaped Q4_K_M GGUF of random weights, made as
users' files are made: transformers saves the checkpoint, llama.cpp's own `convert_hf_to_gguf.py`
writes it as a BF16 GGUF and llama.cpp's quantizer (`llama_model_quantize`, llama-quantize's code,
through llama-cpp-python's binding) makes the Q4_K_M file from that.

The shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 query and 8 KV heads of 64, MLP 8192, tied
embeddings, RoPE theta 500,000) with two differences: the vocabulary is SmolLM2's 49,152 tokens
(its tokenizer comes with the embedded model, offline; Llama 3's 128,256-token one does not), so
the tied head reads 0.4x the bytes of the real model's, and RoPE runs unscaled (no `llama3`
scaling, which changes no tensor size or step cost) over 8,192 positions. Random weights decode
as fast as trained ones.

Idempotent: the file (0.67 GB) is cached as benchmarks/.models/llama-1b-q4km.gguf (ignored by
git) and made only when missing, in about 4 minutes on 2 cores, with 2.2 GB of memory and 2.8 GB
of scratch disk beside it:

    LLAMA_CPP_CONVERT=.venv/llama.cpp/convert_hf_to_gguf.py \\
        benchmarks/.venv/bin/python benchmarks/make_1b_gguf.py      # prints the file's path

(`make setup` unpacks the converter; `make bench-env` builds the llama-cpp-python this runs
under. `cpu_generate.py` runs this script itself when the file is missing.)
"""

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "benchmarks" / ".models" / "llama-1b-q4km.gguf"
CONVERTER = ROOT / ".venv" / "llama.cpp" / "convert_hf_to_gguf.py"  # the Makefile's CONVERTER
SHAPE = {  # Llama-3.2-1B's config.json, less its vocabulary and RoPE scaling (see above)
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def checkpoint(folder: Path) -> Path:
    """Random bf16 weights (Llama 3.2's dtype) of SHAPE with SmolLM2's tokenizer, saved."""
    import torch
    import transformers

    from kestrel.weights.loader import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve("smollm2"))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPE,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of float32
    model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def convert(folder: Path, out: Path, script: Path) -> None:
    """llama.cpp's converter, run from its own folder so it imports the gguf-py beside it."""
    command = [sys.executable, script.name, str(folder), "--outfile", str(out)]
    run = subprocess.run(
        [*command, "--outtype", "bf16"], cwd=script.parent, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{run.stderr[-2000:]}")


def quantize(source: Path, out: Path, threads: int) -> None:
    """llama.cpp's quantizer: LLAMA_FTYPE_MOSTLY_Q4_K_M, its own per-tensor type mix."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, threads
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if rc != 0 or not out.exists():
        raise SystemExit(f"llama_model_quantize returned {rc} for {source}")


def make(out: Path, script: Path, threads: int) -> Path:
    """The file at `out`, made in a scratch folder beside it and moved in place only when
    complete, so an interrupted run leaves no half-written file behind."""
    if out.exists():
        return out
    if not script.exists():
        raise SystemExit(
            f"llama.cpp's converter {script} is missing: run `make setup` (it unpacks it) or "
            "pass --convert-script / LLAMA_CPP_CONVERT"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".making-") as scratch:
        scratch = Path(scratch)
        folder = checkpoint(scratch / "hf")
        convert(folder, scratch / "bf16.gguf", script)
        shutil.rmtree(folder)
        quantize(scratch / "bf16.gguf", scratch / out.name, threads)
        os.replace(scratch / out.name, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL)
    parser.add_argument(
        "--convert-script",
        type=Path,
        default=Path(os.environ.get("LLAMA_CPP_CONVERT", CONVERTER)),
        help="llama.cpp's convert_hf_to_gguf.py (default: LLAMA_CPP_CONVERT, else make setup's)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    print(make(args.out.resolve(), args.convert_script.resolve(), args.threads))


if __name__ == "__main__":
    main()
