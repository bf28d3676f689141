"""The CPU's two runners on SmolLM2, same process, same prompts: the reference runner (KV grown by
concatenation) and the paged runner (KV written in place in the pool, PyTorch attention).
Greedy, EOS ignored; prints TTFT and decode tok/s for one 256- and one 1,024-token prompt and
for 8 streams of 64.

    .venv/bin/python benchmarks/cpu_runner_ab.py
"""

import time

import torch

import kestrel.engine.engine as engine_module
from kestrel.config import build_config
from kestrel.engine.paged_runner import make_runner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.sampling import SamplingParams
from kestrel.weights.loader import load


def run(model, tokenizer, paged: bool, prompt_tokens: int, output_tokens: int, streams: int = 1):
    engine_module.make_runner = make_runner if paged else (lambda m, d, c, n: ModelRunner(m, d))
    engine = engine_module.Engine(model, tokenizer, build_config())
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    for s in range(streams):
        engine.add_request(f"r{s}", list(range(100 + s, 100 + s + prompt_tokens)), params)
    start, first, generated = time.perf_counter(), None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        generated += sum(len(o.new_token_ids) for o in outputs)
        if first is None and outputs:
            first = time.perf_counter()
    decode = (generated - streams) / (time.perf_counter() - first)
    runner = "paged" if paged else "reference"
    print(
        f"{runner:9} prompt={prompt_tokens:5} streams={streams} ttft={first - start:.3f}s "
        f"decode={decode:.1f} tok/s",
        flush=True,
    )


def main() -> None:
    torch.set_num_threads(2)
    model, tokenizer, _ = load("smollm2", torch.float32, torch.device("cpu"), False)
    for paged in (False, True):
        run(model, tokenizer, paged, 256, 64)
        run(model, tokenizer, paged, 1024, 32)
        run(model, tokenizer, paged, 64, 32, streams=8)


if __name__ == "__main__":
    main()
