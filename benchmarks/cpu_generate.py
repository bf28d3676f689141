"""CPU prefill and decode speed of kestrel, llama.cpp (two builds) and transformers on the
embedded models and a 1B-class file.

All run the same GGUF file, the same prompt token ids (from kestrel's tokenizer; llama.cpp gets
them as tokens, not text) and greedy decoding on the same number of threads. Per model and system:

- `load`: seconds from a cold load to the first token of a short warm-up request (once);
- `prefill`: prompt tokens / time to the first token, at each `--prompt-tokens` (256, 1,024);
- `decode`: `--decode-tokens` (128) / the time after the first token, after the shortest prompt;
- `decode_streams` (kestrel): `--streams` (8) requests of that prompt at once, the tokens
  generated from when the last got its first token until all finished / that time.

The models: `smollm2` and `gemma3-270m` (the embedded ones) and `llama-1b-q4km`, a
Llama-3.2-1B-shaped Q4_K_M file of random weights that llama.cpp's converter and quantizer write
(make_1b_gguf.py, run here when the file is missing), where decode is bound by memory.

llama.cpp runs in both builds, each in a worker process of its own (llama_cpp_worker.py under
that build's python): `no-amx`, the Makefile's build without AMX (`make bench-env`), and
`default`, as `pip install llama-cpp-python` builds it (`make bench-env-default`). A build that
crashes on a file (llama.cpp's AMX path does on Q4_K_M on some CPUs, llama.cpp#20824) gets a
`crashed` record and drops out of that model's runs.

All systems stay loaded and each measurement is repeated `--repeats` (3) times, the systems
interleaved (kestrel, llama.cpp no-amx, llama.cpp default, [transformers], kestrel, ...), so slow
spells of a noisy machine fall on all of them. Each measurement's record gives the median
(`tok_s`), its `tok_s_min` and `tok_s_max` and every run (`tok_s_runs`). Every run has its own
prompt (a different opening), so no prefix cache serves it.

kestrel and transformers compute in float32 (transformers from weights dequantized at load),
llama.cpp in its quantized kernels with its default f16 KV cache. Run it on a quiet machine: with
a thread per core, another busy process slows every system several-fold, unevenly.

A `ratios` line per model and peer follows, from the medians: kestrel / peer for each prefill and
decode, and kestrel's streams / the peer's single stream (llama-cpp-python's high-level API runs
one sequence), with the range of the runs' paired ratios (`paired`). The `kestrel/llama.cpp`
line compares with the faster build that ran the file, per measurement (`peer_build`). One JSON
line per measurement on stdout; `--out` also writes them, `--plot` draws them as grouped bars.

    make bench BENCH_ARGS='--out benchmarks/results/cpu_generate.jsonl \\
        --plot benchmarks/results/cpu_generate.svg'

(`make bench` builds both environments, unpacks llama.cpp's converter and runs this script as
benchmarks/.venv/bin/python.)
"""

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from cpu_report import key, label, plot, ratios, summarize  # this folder: the script's own

from kestrel import LLM, SamplingParams
from kestrel.weights.loader import load_tokenizer, resolve

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("smollm2", "gemma3-270m", "llama-1b-q4km")
# each llama.cpp build's python: make bench-env's (built without AMX), make bench-env-default's
LLAMA_CPP_BUILDS = {
    "no-amx": "benchmarks/.venv/bin/python",
    "default": "benchmarks/.venv-default/bin/python",
}
FILLER = "The quick brown fox jumps over the lazy dog. "
WARMUP = (16, 4)  # prompt tokens, new tokens
REPEAT_VARIANTS = 1000  # prompt variants a repeat spans: repeat r uses r * 1000 + its own
# a pause before each run, so the last system's idle threads (OpenMP's, ggml's) stop spinning
SETTLE_S = 0.5


def model_source(alias: str) -> str:
    """What the systems load: an embedded alias, or the 1B-class file's path, made by
    make_1b_gguf.py in its own process when missing (its 2 GB of bf16 weights stay out of this
    one)."""
    if alias != "llama-1b-q4km":
        return alias
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_1b_gguf import MODEL

    if not MODEL.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_1b_gguf.py")], check=True)
    return str(MODEL)


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


class System:
    """What the runs ask of each system beyond `run(prompt, new_tokens) -> Timing`."""

    name = ""

    def info(self) -> dict:
        """Fields that join each of the system's records."""
        return {}

    def load_info(self) -> dict:
        """Fields that join only its load record."""
        return {}

    def close(self) -> None:
        """Free what it holds before the next model loads."""


class Kestrel(System):
    """kestrel's engine, driven step by step as the server drives it."""

    name = "kestrel"

    def __init__(self, model: str, args):
        self.llm = LLM(model, progress=False, device="cpu", max_num_seqs=args.streams)
        self.engine = self.llm.engine
        self.ids = itertools.count()

    def info(self) -> dict:
        scheduler = self.llm.config.scheduler
        return {
            "prefill_chunk_size": scheduler.prefill_chunk_size,
            "token_budget": scheduler.token_budget,
        }

    def close(self) -> None:
        self.llm.shutdown()

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


class Crashed(Exception):
    """A llama.cpp build's worker died (a signal: "crashed") or answered an error ("failed"): a
    record of the peer, not a failure of the benchmark."""

    def __init__(self, metric: str, returncode: int | None, detail: str):
        super().__init__(f"{metric} ({returncode}): {detail}")
        self.record = {"metric": metric, "returncode": returncode, "detail": detail}


class LlamaCpp(System):
    """llama.cpp through llama-cpp-python's Llama, one sequence fed token ids, in a worker process
    (llama_cpp_worker.py) under the python of one build: `make bench-env`'s without AMX, or
    `make bench-env-default`'s."""

    name = "llama.cpp"

    def __init__(self, model: str, args, build: str):
        self.build, self.n_batch = build, 512  # llama-cpp-python's default n_batch, written down
        python = ROOT / LLAMA_CPP_BUILDS[build]
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the worker)
        self.worker = subprocess.Popen(
            [str(python), str(ROOT / "benchmarks" / "llama_cpp_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        n_ctx = max(args.prompt_tokens) + args.decode_tokens + 16
        spec = {"model": str(resolve(model).path), "n_ctx": n_ctx, "n_batch": self.n_batch}
        self.loaded = self._ask(spec | {"threads": args.threads})

    def _ask(self, request: dict) -> dict:
        try:
            self.worker.stdin.write(json.dumps(request) + "\n")
            self.worker.stdin.flush()
        except BrokenPipeError:
            pass  # it has died; its exit status, read below, says how
        line = self.worker.stdout.readline()
        if not line:
            returncode = self.worker.wait()
            crashed = returncode < 0  # killed by a signal: SIGSEGV, SIGILL, SIGABRT
            raise Crashed("crashed" if crashed else "failed", returncode, self._stderr_tail())
        answer = json.loads(line)
        if "error" in answer:
            raise Crashed("failed", None, answer["error"])
        return answer

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-1500:]

    def info(self) -> dict:
        version = self.loaded["llama_cpp_python"]
        return {"build": self.build, "n_batch": self.n_batch, "llama_cpp_python": version}

    def load_info(self) -> dict:
        """llama.cpp's system info names the instruction sets compiled in (AMX_INT8 among them)."""
        system_info = self.loaded["system_info"]
        return {"amx": "AMX_INT8 = 1" in system_info, "system_info": system_info}

    def run(self, prompt: list[int], new_tokens: int) -> Timing:
        t = self._ask({"prompt": prompt, "new_tokens": new_tokens})
        return Timing(t["first_token_s"], t["decode_s"], t["prefill_steps"])

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a worker that crashed
            self.worker.stdin.close()
        self.worker.wait()
        self.stderr.close()


class Transformers(System):
    """transformers' generate() on the GGUF file, dequantized to float32."""

    name = "transformers"

    def __init__(self, model: str, args):
        from transformers import AutoModelForCausalLM

        path = resolve(model).path
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


def systems_to_load(args) -> list[tuple[str, tuple]]:
    """(name, extra constructor arguments) in the order the runs interleave them."""
    out = []
    for name in args.systems:
        builds = args.llama_cpp_builds if name == "llama.cpp" else [None]
        out += [(name, (build,) if build else ()) for build in builds]
    return out


def load(name: str, extra: tuple, model: str, args, warmup: list[int]) -> tuple[object, dict]:
    """Construct the system and run a short warm-up request, so one-time costs (kernel builds,
    first-call allocations) stay out of the timings; `load_s` is construction plus that
    request's first token."""
    start = time.perf_counter()
    system = SYSTEMS[name](model, args, *extra)
    built = time.perf_counter() - start
    first = system.run(warmup, WARMUP[1]).first_token_s
    record = {"metric": "load", "load_s": built + first, "construct_s": built}
    return system, record | system.load_info()


def prefill_record(system, tokenizer, args, n: int, variant: int) -> dict:
    t = system.run(prompt_ids(tokenizer, n, variant), 1)
    return (
        {"metric": "prefill", "prompt_tokens": n, "tok_s": n / t.first_token_s}
        | {"seconds": t.first_token_s, "prefill_steps": t.prefill_steps}
        | ({"cached_tokens": t.cached_tokens} if isinstance(system, Kestrel) else {})
    )


def decode_record(system, tokenizer, args, variant: int) -> dict:
    """Decode tok/s of one stream after the shortest prompt (transformers may take fewer)."""
    n = min(args.prompt_tokens)
    decode_tokens = args.decode_tokens
    if isinstance(system, Transformers):
        decode_tokens = args.transformers_decode_tokens
    t = system.run(prompt_ids(tokenizer, n, variant), decode_tokens + 1)
    return {
        "metric": "decode",
        "prompt_tokens": n,
        "decode_tokens": decode_tokens,
        "tok_s": decode_tokens / t.decode_s,
        "seconds": t.decode_s,
    }


def streams_record(system, tokenizer, args, variant: int) -> dict | None:
    """kestrel's `--streams` requests of the shortest prompt, each its own variant."""
    if not isinstance(system, Kestrel):
        return None
    n = min(args.prompt_tokens)
    prompts = [prompt_ids(tokenizer, n, variant + i) for i in range(args.streams)]
    timing = system.streams(prompts, args.decode_tokens + 1)
    return {"metric": "decode_streams", "streams": args.streams, "prompt_tokens": n} | timing


def measurements(args) -> list[tuple]:
    """(record function, extra arguments, the prompt variant in repeat 0) of each measurement."""
    prefills = [(prefill_record, (n,), i) for i, n in enumerate(args.prompt_tokens, start=1)]
    return [*prefills, (decode_record, (), 100), (streams_record, (), 200)]


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
    parser.add_argument(
        "--llama-cpp-builds",
        nargs="+",
        default=list(LLAMA_CPP_BUILDS),
        choices=list(LLAMA_CPP_BUILDS),
        help="llama.cpp's builds: no-amx (make bench-env), default (make bench-env-default)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement")
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
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.streams >= REPEAT_VARIANTS - 200:  # each repeat's stream prompts are 200 + i
        parser.error(f"--streams must be below {REPEAT_VARIANTS - 200}")
    check_builds(parser, args)
    args.transformers_decode_tokens = args.transformers_decode_tokens or args.decode_tokens
    return args


def check_builds(parser, args) -> None:
    """Each llama.cpp build asked for has its environment."""
    targets = {"no-amx": "make bench-env", "default": "make bench-env-default"}
    if "llama.cpp" not in args.systems or args.replot:
        return
    for build in args.llama_cpp_builds:
        if not (ROOT / LLAMA_CPP_BUILDS[build]).exists():
            parser.error(
                f"llama.cpp's {build} build is missing ({LLAMA_CPP_BUILDS[build]}): run "
                f"`{targets[build]}`, or leave it out with --llama-cpp-builds"
            )


class Model:
    """One model's systems, loaded side by side so that their runs can interleave."""

    def __init__(self, alias: str, args, lines: Lines):
        self.alias, self.args, self.lines = alias, args, lines
        source = model_source(alias)
        self.tokenizer = load_tokenizer(resolve(source))
        warmup = prompt_ids(self.tokenizer, WARMUP[0], 0)
        self.systems = []
        for name, extra in systems_to_load(args):
            base = {"system": name} | ({"build": extra[0]} if extra else {})
            try:
                system, record = load(name, extra, source, args, warmup)
            except Crashed as crash:
                self._add(base | {"during": "load"} | crash.record)
                continue
            self.systems.append(system)
            self._add(base | record | system.info())

    def _add(self, record: dict) -> None:
        self.lines.add({"model": self.alias} | record)

    def measure(self) -> list[dict]:
        """Every measurement `--repeats` times, the systems interleaved within each; a llama.cpp
        build that crashes gets its record and leaves the rotation. The summaries."""
        runs: dict[tuple, list[dict]] = {}
        for repeat, (record_of, extra, variant) in itertools.product(
            range(self.args.repeats), measurements(self.args)
        ):
            for system in list(self.systems):
                variant_here = variant + REPEAT_VARIANTS * repeat
                record = self._run(system, record_of, extra, variant_here)
                if record is not None:
                    runs.setdefault((label(record), key(record)), []).append(record)
        summaries = [summarize(r) for r in runs.values()]
        for record in summaries:
            self._add(record)
        return summaries

    def _run(self, system, record_of, extra: tuple, variant: int) -> dict | None:
        time.sleep(SETTLE_S)
        try:
            record = record_of(system, self.tokenizer, self.args, *extra, variant)
        except Crashed as crash:
            self.systems.remove(system)
            during = record_of.__name__.removesuffix("_record")
            self._add({"system": system.name, "during": during} | crash.record | system.info())
            system.close()
            return None
        if record is None:
            return None
        record = {"system": system.name} | record | system.info()
        # progress on stderr: the records come once every run of the model is done
        print(
            f"{self.alias} {label(record)} {key(record)}: {record['tok_s']:.1f} tok/s",
            file=sys.stderr,
        )
        return record

    def close(self) -> None:
        for system in self.systems:
            system.close()
        self.systems.clear()
        gc.collect()


def run_model(alias: str, args, lines: Lines) -> None:
    """Every chosen system on one model, then kestrel's ratios to the others."""
    model = Model(alias, args, lines)
    try:
        summaries = model.measure()
    finally:
        model.close()
    if "kestrel" in args.systems:
        for line in ratios(alias, summaries):
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
        "repeats": args.repeats,
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
