"""LoRA serving speed against the base model, in one run on one device: a batch of requests
spread over N random rank-R adapters (PEFT's files, on every q/k/v/o and MLP projection), and a
single stream with one adapter, each against the same requests on the base model (LoRA off).

    python benchmarks/lora_speed.py --shape llama3-8b --adapters 4 --rank 16 --batch 64

Prints one JSON line per measurement (tokens/s, and the ratio to the base); the issue's bar:
batch >= 0.8x, single stream >= 0.9x.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kestrel import LLM, SamplingParams
from kestrel.models.layers.lora import TARGETS


def write_adapters(llm: LLM, folder: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random PEFT adapters of rank `rank` on every adaptable projection of the model."""
    linears = {
        n: m
        for n, m in llm.model.named_modules()
        if n.rsplit(".", 1)[-1] in TARGETS and hasattr(m, "in_features")
    }
    adapters = {}
    for i in range(count):
        tensors = {}
        for name, m in linears.items():
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, m.in_features) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(m.out_features, rank) * 0.01
        path = folder / f"adapter{i}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
        (path / "adapter_config.json").write_text(json.dumps(config))
        adapters[f"adapter{i}"] = str(path)
    return adapters


def throughput(llm: LLM, batch: int, tokens: int, adapters: list[str | None]) -> float:
    """Generated tokens/s of `batch` requests (request i on adapters[i % len]), greedy."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine = llm.engine
    for i in range(batch):
        prompt = [(i * 31 + j) % 1000 + 10 for j in range(32)]
        engine.add_request(
            f"bench-{time.monotonic_ns()}-{i}", prompt, params, lora=adapters[i % len(adapters)]
        )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(out.new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def measure(llm: LLM, names: list[str | None], args) -> dict[str, float]:
    throughput(llm, min(args.batch, 8), 8, names)  # warm-up (Triton compiles)
    result = {
        "batch": throughput(llm, args.batch, args.tokens, names),
        "single": throughput(llm, 1, args.tokens, names[:1]),
    }
    if args.profile:
        profile_batch(llm, names, args)
    return result


def profile_batch(llm: LLM, names: list[str | None], args) -> None:
    """The GPU kernels of a short batch run that took longest, on stderr (this side's name)."""
    from profile_steps import kernel_table  # benchmarks/ is the script's folder

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        throughput(llm, args.batch, 16, names)
    print(f"--- {args.run}: batch {args.batch}, 16 tokens", file=sys.stderr)
    print(kernel_table(prof, 25), file=sys.stderr, flush=True)


def run_one(args) -> dict[str, float]:
    """One side's tokens/s, in a process of its own (each LLM sizes its KV pool from free
    memory): the base model with LoRA off, or LoRA on with `--adapters` random adapters."""
    common = dict(shape=args.shape, max_num_seqs=args.batch, progress=False)
    if args.run == "base":
        return measure(LLM(**common), [None], args)
    llm = LLM(**common, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(llm, Path(tmp), args.adapters, args.rank)
        for name, path in adapters.items():
            llm.load_lora(name, path)
    return measure(llm, list(adapters), args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="each side's top kernels, on stderr")
    p.add_argument("--run", choices=["base", "lora"], help=argparse.SUPPRESS)  # one side
    args = p.parse_args()
    if args.run:
        print(json.dumps(run_one(args)), flush=True)
        return
    results = {side: _side(side) for side in ("base", "lora")}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = os.environ.get("KESTREL_COMMIT") or git.stdout.strip()  # a copy's git may be stale
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for kind in ("batch", "single"):
        line = {
            "measurement": f"lora_{kind}",
            "command": " ".join(["python", *sys.argv]),
            "shape": args.shape,
            "adapters": args.adapters if kind == "batch" else 1,
            "rank": args.rank,
            "requests": args.batch if kind == "batch" else 1,
            "base_tok_s": round(results["base"][kind], 1),
            "lora_tok_s": round(results["lora"][kind], 1),
            "ratio": round(results["lora"][kind] / results["base"][kind], 3),
            "device": device,
            "commit": commit,
        }
        print(json.dumps(line), flush=True)


def _side(side: str) -> dict[str, float]:
    run = subprocess.run(  # stderr passes through: the --profile tables
        [sys.executable, *sys.argv, "--run", side], stdout=subprocess.PIPE, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
