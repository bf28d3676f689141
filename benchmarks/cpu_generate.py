"""CPU prefill and decode speed of kestrel and transformers on the embedded real models.

Both run the same GGUF weights in float32 in the same process, one after the other, so their
ratio holds on a noisy machine. One JSON line per measurement on stdout; `--out` also writes them.

    python benchmarks/cpu_generate.py --out benchmarks/results/cpu_generate.json
"""

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

from kestrel import LLM, SamplingParams


def kestrel_speed(llm: LLM, prompt_ids: list[int], decode_tokens: int) -> dict:
    engine = llm.engine
    engine.add_request(
        "bench",
        prompt_ids,
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=decode_tokens + 1),
    )
    start = time.perf_counter()
    engine.step()  # the whole prompt in one chunk, and the first token
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode = time.perf_counter() - start
    return {"prefill_tok_s": len(prompt_ids) / prefill, "decode_tok_s": decode_tokens / decode}


def transformers_speed(alias: str, prompt_ids: list[int], decode_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from kestrel.weights.loader import resolve

    path = resolve(alias).path
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(
            ids, max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1, do_sample=False
        )
        total = time.perf_counter() - start
    # generate() repeats the prefill; subtract it to leave the decode steps
    return {
        "prefill_tok_s": len(prompt_ids) / prefill,
        "decode_tok_s": decode_tokens / max(total - prefill, 1e-9),
    }


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args()
    context = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "commit": commit(),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "dtype": "float32",
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
    }
    lines = []
    for alias in args.models:
        llm = LLM(alias, progress=False, device="cpu")
        text = "The quick brown fox jumps over the lazy dog. " * args.prompt_tokens
        prompt = llm.tokenizer(text)["input_ids"][: args.prompt_tokens]
        for system, speed in (
            ("kestrel", kestrel_speed(llm, prompt, args.decode_tokens)),
            ("transformers", transformers_speed(alias, prompt, args.decode_tokens)),
        ):
            lines.append(json.dumps({"model": alias, "system": system, **speed, **context}))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
