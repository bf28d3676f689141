"""What the CPU's int8 activations (kernels/cpu/gguf_int8.h, decode's default where the CPU has
VNNI) cost in accuracy against the float path (KESTREL_CPU_INT8=0, exact to the file's weights):
the same model, prompt and greedy decoding through both paths in one process.

Per model and prompt: `steps` greedy tokens from each path; `agree`: how many leading tokens are
the same; over those steps the largest |log-prob difference| of the float path's token and of any
of its 5 likeliest (`max_abs_logprob_diff`, `max_abs_top5_diff`); where the paths part, the float
path's margin there (its top two log-probs' difference): a near tie, or not. One JSON line each.

    python benchmarks/int8_accuracy.py --steps 64 -o benchmarks/results/cpu-int8-accuracy-COMMIT.jsonl
"""

import argparse
import contextlib
import json
import os

from kestrel import LLM, SamplingParams
from kestrel.kernels import cpu_native

PROMPTS = (
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Question: what is the capital of France? Answer:",
)


@contextlib.contextmanager
def int8_path(on: bool):
    """The user's switch KESTREL_CPU_INT8 (which gguf_mm asks at every call) set within the
    block, and what it was put back after (the tests call `compare` in a shared process)."""
    before = os.environ.get("KESTREL_CPU_INT8")
    os.environ["KESTREL_CPU_INT8"] = "1" if on else "0"
    cpu_native.int8_activations.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["KESTREL_CPU_INT8"]
        else:
            os.environ["KESTREL_CPU_INT8"] = before
        cpu_native.int8_activations.cache_clear()


def decode(llm: LLM, prompt: str, steps: int, int8: bool):
    """(token ids, per-step {id: log-prob}) of `steps` greedy tokens through one path."""
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=5)
    with int8_path(int8):
        out = llm.generate([prompt], params)[0].outputs[0]
    return out.token_ids, out.logprobs


def compare(model: str, prompt: str, steps: int, llm: LLM) -> dict:
    exact_ids, exact = decode(llm, prompt, steps, int8=False)
    int8_ids, int8 = decode(llm, prompt, steps, int8=True)
    agree = next(
        (i for i, (a, b) in enumerate(zip(exact_ids, int8_ids, strict=True)) if a != b), steps
    )
    chosen = [abs(exact[i][t] - int8[i][t]) for i, t in enumerate(exact_ids[:agree])]
    top = [abs(lp - int8[i][t]) for i in range(agree) for t, lp in exact[i].items() if t in int8[i]]
    record = {
        "model": model,
        "prompt": prompt,
        "steps": steps,
        "agree": agree,
        "max_abs_logprob_diff": max(chosen, default=0.0),
        "max_abs_top5_diff": max(top, default=0.0),
    }
    if agree < steps:
        best = sorted(exact[agree].values(), reverse=True)
        record["margin_where_they_part"] = best[0] - best[1]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("-o", "--out", help="also write the JSON lines here")
    args = parser.parse_args()
    lines = []
    for model in args.models:
        llm = LLM(model, progress=False, device="cpu", max_num_seqs=1, prefix_caching=False)
        for prompt in PROMPTS:
            record = compare(model, prompt, args.steps, llm)
            record["commit"] = os.environ.get("KESTREL_COMMIT", "")
            lines.append(json.dumps(record))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
