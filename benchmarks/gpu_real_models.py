"""Greedy tokens of a real GGUF model on the GPU against the CPU reference path, same machine.

fp32 on CUDA must equal the CPU token for token; bf16 is reported as the number of leading tokens
that agree and the largest first-step log-prob difference (bf16's tolerance, not equality).

    python benchmarks/gpu_real_models.py MODEL [--out FILE]
"""

import argparse
import gc
import json
import sys

import torch

from kestrel import LLM, SamplingParams

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "The history of the Roman Empire"]


def greedy(llm: LLM, prompts: list[list[int]], steps: int) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0)
    return [
        {
            "ids": r.outputs[0].token_ids,
            "logprobs": [max(lp.values()) for lp in r.outputs[0].logprobs],
        }
        for r in llm.generate(prompts, params)
    ]


def agree(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    cpu = LLM(args.model, device="cpu", dtype="float32", progress=False)
    # both paths get the same ids: this compares the forward passes, not two tokenizer loads
    # (the second load reads the converted tokenizer from kestrel's cache)
    prompts = [cpu.tokenizer.encode(p) for p in PROMPTS]
    reference = greedy(cpu, prompts, args.steps)
    del cpu
    lines = []
    for dtype in args.dtypes:
        llm = LLM(args.model, device="cuda", dtype=dtype, progress=False)
        runs = greedy(llm, prompts, args.steps)
        del llm  # the next engine sizes its KV pool from the memory this one frees
        gc.collect()
        torch.cuda.empty_cache()
        for prompt, ids, ref, run in zip(PROMPTS, prompts, reference, runs, strict=True):
            line = {
                "model": args.model,
                "dtype": dtype,
                "prompt": prompt,
                "prompt_ids": ids,
                "steps": args.steps,
                "tokens_equal": run["ids"] == ref["ids"],
                "leading_tokens_agree": agree(run["ids"], ref["ids"]),
                "first_logprob_diff": abs(run["logprobs"][0] - ref["logprobs"][0]),
                "gpu": torch.cuda.get_device_name(),
                "command": " ".join(["python", *sys.argv]),
            }
            lines.append(json.dumps(line))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
