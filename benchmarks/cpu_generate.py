"""CPU prefill and decode speed of kestrel, llama.cpp and transformers on the embedded models.

All three run the same GGUF file, the same prompt token ids (from kestrel's tokenizer; llama.cpp
gets them as tokens, not text) and greedy decoding on the same number of threads, one after the
other in one process, so their ratios hold on a noisy machine. Per model and system:

- `load`: seconds from a cold load to the first token of a short warm-up request;
- `prefill`: prompt tokens / time to the first token, at each `--prompt-tokens` (256, 1,024);
- `decode`: `--decode-tokens` (128) / the time after the first token, after the shortest prompt;
- `decode_streams` (kestrel): `--streams` (8) requests of that prompt at once, the tokens
  generated from when the last got its first token until all finished / that time.

Each measurement has its own prompt (a different opening), so no prefix cache serves it.
kestrel and transformers compute in float32 (transformers from weights dequantized at load),
llama.cpp in its quantized kernels with its default f16 KV cache. Run it on a quiet machine:
with a thread per core, another busy process slows every system several-fold, unevenly.

llama-cpp-python's high-level API runs one sequence, so kestrel's streams are compared with its
single stream. A `ratios` line per model and peer follows: kestrel / peer for each prefill and
decode, and kestrel's streams / the peer's single stream. One JSON line per measurement on
stdout; `--out` also writes them, `--plot` draws them as grouped bars.

llama.cpp comes from llama-cpp-python built from source in the benchmark's own environment
(`make bench-env`: benchmarks/.venv from benchmarks/requirements-cpu.txt):

    make bench-env
    benchmarks/.venv/bin/python benchmarks/cpu_generate.py \\
        --out benchmarks/results/cpu_generate.jsonl --plot benchmarks/results/cpu_generate.svg
"""

import argparse
import gc
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from kestrel import LLM, SamplingParams
from kestrel.weights.loader import load_tokenizer, resolve

MODELS = ("smollm2", "gemma3-270m")
FILLER = "The quick brown fox jumps over the lazy dog. "
WARMUP = (16, 4)  # prompt tokens, new tokens


@dataclass
class Timing:
    """One greedy request: time to its first token, then for the tokens after it."""

    first_token_s: float
    decode_s: float
    prefill_steps: int  # forwards (engine steps, llama.cpp batches) until the first token
    cached_tokens: int = 0  # kestrel: prompt tokens its prefix cache served (0 is intended)


def prompt_ids(tokenizer, n: int, variant: int) -> list[int]:
    """`n` token ids; each variant starts differently so no prefix cache serves another's."""
    text = f"Passage {variant}. " + FILLER * n
    ids = tokenizer(text)["input_ids"][:n]
    if len(ids) < n:
        raise ValueError(f"the filler text gives {len(ids)} tokens, fewer than {n}")
    return ids


class Lines:
    """JSON lines to stdout and, with `--out`, to a file as each is measured, so a run that
    fails keeps what it measured; `context` (threads, commit, machine, command) joins each."""

    def __init__(self, path: str | None, context: dict):
        self.file = open(path, "w") if path else None
        self.context = context
        self.records: list[dict] = []

    def add(self, record: dict) -> None:
        self.records.append(record | self.context)
        line = json.dumps(self.records[-1])
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


class Kestrel:
    """kestrel's engine, driven step by step as the server drives it."""

    name = "kestrel"

    def __init__(self, alias: str, args):
        self.llm = LLM(alias, progress=False, device="cpu", max_num_seqs=args.streams)
        self.engine = self.llm.engine
        self.ids = itertools.count()

    def info(self) -> dict:
        scheduler = self.llm.config.scheduler
        return {
            "prefill_chunk_size": scheduler.prefill_chunk_size,
            "token_budget": scheduler.token_budget,
        }

    def _add(self, prompt: list[int], new_tokens: int) -> None:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
        self.engine.add_request(f"bench-{next(self.ids)}", prompt, params)

    def _step(self) -> list:
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:
                raise out.error
        return outputs

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        """One request; the engine splits a long prompt into chunks of its token budget, so
        the first token may take several steps. Greedy, EOS ignored."""
        self._add(prompt, new_tokens)
        start, first, steps, cached = time.perf_counter(), None, 0, 0
        while self.engine.has_unfinished():
            outputs = self._step()
            if first is None:
                steps += 1
                if any(out.new_token_ids for out in outputs):
                    first, cached = time.perf_counter(), outputs[0].num_cached_tokens
        return Timing(first - start, time.perf_counter() - first, steps, cached)

    def streams(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """All requests queued at once. The window opens at the step where the last of them
        gets its first token and closes when all finish; tok/s = tokens generated in it / its
        time. Streams that started earlier have decoded some tokens before it (`ahead`)."""
        for prompt in prompts:
            self._add(prompt, new_tokens)
        started, ahead = set(), 0
        while len(started) < len(prompts):
            outputs = self._step()
            ahead += sum(len(out.new_token_ids) for out in outputs if out.request_id in started)
            started |= {out.request_id for out in outputs if out.new_token_ids}
        start, generated = time.perf_counter(), 0
        while self.engine.has_unfinished():
            generated += sum(len(out.new_token_ids) for out in self._step())
        seconds = time.perf_counter() - start
        return {
            "tok_s": generated / seconds,
            "seconds": seconds,
            "tokens": generated,
            "ahead": ahead,
        }


class LlamaCpp:
    """llama.cpp through llama-cpp-python's Llama: one sequence, fed token ids."""

    name = "llama.cpp"

    def __init__(self, alias: str, args):
        from llama_cpp import Llama

        self.n_batch = 512  # llama-cpp-python's default, written down: it sets prefill's batches
        self.llm = Llama(
            model_path=str(resolve(alias).path),
            n_ctx=max(args.prompt_tokens) + args.decode_tokens + 16,
            n_batch=self.n_batch,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )

    def info(self) -> dict:
        import llama_cpp

        return {"n_batch": self.n_batch, "llama_cpp_python": llama_cpp.__version__}

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        """`reset()` forgets the previous prompt so none of its KV is reused; `generate()` then
        evaluates the prompt in batches of n_batch and each token after it, greedy (temperature
        0, no repeat penalty), never stopping on EOS."""
        self.llm.reset()
        start = time.perf_counter()
        tokens = self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
        next(tokens)
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            next(tokens)
        end = time.perf_counter()
        tokens.close()
        return Timing(first - start, end - first, math.ceil(len(prompt) / self.n_batch))


class Transformers:
    """transformers' generate() on the GGUF file, dequantized to float32."""

    name = "transformers"

    def __init__(self, alias: str, args):
        from transformers import AutoModelForCausalLM

        path = resolve(alias).path
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()

    def info(self) -> dict:
        import transformers

        return {"transformers": transformers.__version__}

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        """generate() calls its stopping criteria once per token: the first call marks the
        first token, the last the end. Greedy; `min_new_tokens` ignores EOS."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        times = []

        class Clock(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([Clock()]),
            )
        return Timing(times[0] - start, times[-1] - times[0], 1)


SYSTEMS = {cls.name: cls for cls in (Kestrel, LlamaCpp, Transformers)}


def load(cls, alias: str, args, warmup: list[int]) -> tuple[object, dict]:
    """Construct the system and run a short warm-up request, so one-time costs (kernel builds,
    first-call allocations) stay out of the timings; `load_s` is construction plus that
    request's first token."""
    start = time.perf_counter()
    system = cls(alias, args)
    built = time.perf_counter() - start
    first = system.run(warmup, WARMUP[1]).first_token_s
    return system, {"metric": "load", "load_s": built + first, "construct_s": built}


def measure(cls, alias: str, args, tokenizer) -> list[dict]:
    """One system's records on one model: load, prefill at each prompt length, decode, and
    (kestrel) concurrent streams."""
    system, load_record = load(cls, alias, args, prompt_ids(tokenizer, WARMUP[0], 0))
    records = [load_record]
    for variant, n in enumerate(args.prompt_tokens, start=1):
        t = system.run(prompt_ids(tokenizer, n, variant), 1)
        records.append(
            {"metric": "prefill", "prompt_tokens": n, "tok_s": n / t.first_token_s}
            | {"seconds": t.first_token_s, "prefill_steps": t.prefill_steps}
            | ({"cached_tokens": t.cached_tokens} if cls is Kestrel else {})
        )
    records.append(decode_record(system, tokenizer, args))
    if cls is Kestrel:
        records.append(streams_record(system, tokenizer, args))
    info = system.info()
    del system
    gc.collect()
    return [r | info for r in records]


def streams_record(system: "Kestrel", tokenizer, args) -> dict:
    """kestrel's `--streams` requests of the shortest prompt, each its own variant."""
    n = min(args.prompt_tokens)
    prompts = [prompt_ids(tokenizer, n, 200 + i) for i in range(args.streams)]
    timing = system.streams(prompts, args.decode_tokens + 1)
    return {"metric": "decode_streams", "streams": args.streams, "prompt_tokens": n} | timing


def decode_record(system, tokenizer, args) -> dict:
    """Decode tok/s of one stream after the shortest prompt (transformers may take fewer)."""
    n = min(args.prompt_tokens)
    decode_tokens = args.decode_tokens
    if isinstance(system, Transformers):
        decode_tokens = args.transformers_decode_tokens
    t = system.run(prompt_ids(tokenizer, n, 100), decode_tokens + 1)
    return {
        "metric": "decode",
        "prompt_tokens": n,
        "decode_tokens": decode_tokens,
        "tok_s": decode_tokens / t.decode_s,
        "seconds": t.decode_s,
    }


def key(record: dict) -> str:
    """A measurement's name in ratios and plots: prefill_256, decode, decode_streams."""
    if record["metric"] == "prefill":
        return f"prefill_{record['prompt_tokens']}"
    return record["metric"]


def speeds(records: list[dict], system: str) -> dict[str, float]:
    return {key(r): r["tok_s"] for r in records if r["system"] == system and "tok_s" in r}


def ratios(alias: str, records: list[dict]) -> list[dict]:
    """kestrel / each peer: each prefill, decode, and kestrel's streams over the peer's single
    stream (`streams_vs_single`)."""
    ours, out = speeds(records, "kestrel"), []
    for peer in [s for s in SYSTEMS if s != "kestrel" and any(r["system"] == s for r in records)]:
        theirs = speeds(records, peer)
        line = {"model": alias, "system": f"kestrel/{peer}", "metric": "ratios"}
        for name, value in ours.items():
            single = "decode" if name == "decode_streams" else name
            if single in theirs:
                line["streams_vs_single" if single != name else name] = value / theirs[single]
        out.append(line)
    return out


LABELS = {"decode": "decode, 1 stream", "decode_streams": "decode, {streams} streams"}


def plot(records: list[dict], path: str) -> None:
    """Grouped bars, one panel per model: a group per measurement, a bar per system, tok/s on
    a log axis (prefill and decode differ by orders of magnitude), values on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if "tok_s" in r and r["metric"] != "ratios"]
    models = list(dict.fromkeys(r["model"] for r in measured))
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in measured)]
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        mine = [r for r in measured if r["model"] == model]
        bars = {(key(r), r["system"]): r["tok_s"] for r in mine}
        groups = list(dict.fromkeys(key(r) for r in mine))
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(groups))]
            values = [bars.get((g, system), 0) for g in groups]
            drawn = ax.bar(xs, values, width, label=system)
            ax.bar_label(drawn, [_value(v) for v in values], fontsize=8)
        streams = next((r["streams"] for r in mine if "streams" in r), 0)
        labels = [LABELS.get(g, g.replace("_", " ")).format(streams=streams) for g in groups]
        ax.set_xticks(range(len(groups)), labels)
        ax.set_yscale("log")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{model}: {mine[0]['threads']} threads, greedy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _value(tok_s: float) -> str:
    return "" if not tok_s else f"{tok_s:,.0f}" if tok_s >= 100 else f"{tok_s:.1f}"


def commit() -> str:
    try:
        command = ["git", "describe", "--always", "--dirty"]
        return subprocess.check_output(command, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(threads: int) -> str:
    return f"{cpu_name()}, {os.cpu_count()} CPUs, {threads} threads, torch {torch.__version__}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--transformers-decode-tokens", type=int, help="default: --decode-tokens")
    parser.add_argument("--streams", type=int, default=8, help="kestrel's concurrent requests")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--plot", metavar="FILE.svg", help="draw grouped bars to this file")
    parser.add_argument("--replot", metavar="FILE", help="plot these JSON lines; measure nothing")
    args = parser.parse_args()
    if args.replot and not args.plot:
        parser.error("--replot needs --plot FILE.svg")
    args.transformers_decode_tokens = args.transformers_decode_tokens or args.decode_tokens
    return args


def run_model(alias: str, args, lines: Lines) -> None:
    """Every chosen system on one model, then kestrel's ratios to the others."""
    tokenizer = load_tokenizer(resolve(alias))
    records = []
    for name in args.systems:
        for record in measure(SYSTEMS[name], alias, args, tokenizer):
            records.append({"model": alias, "system": name} | record)
            lines.add(records[-1])
    if "kestrel" in args.systems:
        for line in ratios(alias, records):
            lines.add(line)


def main() -> None:
    args = parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot([json.loads(line) for line in f if line.strip()], args.plot)
        return
    torch.set_num_threads(args.threads)  # kestrel's and transformers' intra-op threads
    context = {
        "threads": args.threads,
        "commit": commit(),
        "machine": machine(args.threads),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
    }
    lines = Lines(args.out, context)
    for alias in args.models:
        run_model(alias, args, lines)
    if args.plot:
        plot(lines.records, args.plot)


if __name__ == "__main__":
    main()
