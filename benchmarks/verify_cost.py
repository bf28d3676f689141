"""What a speculative verify step costs against a plain decode step: one sequence of a random-weight
shape, its prompt in, then steps that feed the pending token and k proposed ones (k = 0: a plain
decode) through the paged runner of an engine built for k (its CUDA graphs), timed on the device; and the draft model's one-token step when
`--draft` names a shape, or with `--mtp` the shape's own multi-token-prediction layer's (one
chained round of `--speculative mtp`; its catch-up after each verify step is counted as one
more). From these, the speed-up a draft of acceptance rate a gives: (1 - a^(k+1)) / (1 - a)
tokens per (k draft steps + one verify step), against one token per plain step.

    python benchmarks/verify_cost.py --shape llama3-8b --draft llama3.2-1b --out FILE
    python benchmarks/verify_cost.py --shape glm-4.7-flash --mtp --out FILE
"""

import argparse
import json
import statistics
import sys
import time

import torch

from kestrel.config import build_config
from kestrel.engine.engine import Engine
from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk, take_blocks
from kestrel.loading import resolve_device, resolve_dtype
from kestrel.sampling import SamplingParams
from kestrel.weights.shapes import load_shape

KS = (0, 1, 2, 3, 5, 8)


def step_ms(engine: Engine, k: int, context: int, repeats: int) -> float:
    """Median time of a step that feeds one sequence's pending token and k proposed ones."""
    scheduler, runner = engine.scheduler, engine.runner
    request = prefilled(engine, f"k{k}", context)
    times: list[float] = []
    for _ in range(repeats + 3):  # the first three warm up (kernels compile, graphs load)
        table = take_blocks(scheduler.blocks, request, 1 + k)  # as the scheduler plans it
        chunk = ScheduledChunk(request, 1 + k, [3] * k, table=table)
        (result,) = timed(engine, lambda c=chunk: runner.execute([c]), times)
        tokens = result.tokens or [result.token]
        scheduler.computed([chunk], set(), {request.request_id: len(tokens) - 1})
        request.output_ids += tokens
    engine.abort(request.request_id)
    return 1e3 * statistics.median(times[3:])


def mtp_round_ms(engine: Engine, context: int, repeats: int) -> float:
    """Median time of one chained round of the engine's MTP proposer (one token, one sequence),
    after decode steps that keep its catch-up current."""
    scheduler, runner, proposer = engine.scheduler, engine.runner, engine.scheduler.proposer
    request = prefilled(engine, "mtp", context)  # the proposer catches up on the prompt
    times: list[float] = []
    for _ in range(repeats + 3):
        chunk = ScheduledChunk(request, 1, table=take_blocks(scheduler.blocks, request, 1))
        (result,) = runner.execute([chunk])
        scheduler.computed([chunk], set())
        request.output_ids.append(result.token)
        # the catch-up's token, then one round
        timed(engine, lambda: proposer.propose_all([request], [2]), times)
    engine.abort(request.request_id)
    return 1e3 * statistics.median(times[3:])


def prefilled(engine: Engine, request_id: str, context: int) -> Request:
    """A request whose `context` prompt tokens are in (one chunk) and one output token pending."""
    request = Request(request_id, [1] * context, SamplingParams(temperature=0), 512)
    engine.scheduler.add(request)
    plan = engine.scheduler.schedule()
    engine.runner.step(plan)
    engine.scheduler.computed(plan.chunks, set())
    request.output_ids.append(2)
    return request


def timed(engine: Engine, work, times: list[float]):
    """work(), its time on the device appended to `times`."""
    sync(engine)
    start = time.perf_counter()
    out = work()
    sync(engine)
    times.append(time.perf_counter() - start)
    return out


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def speedup(a: float, k: int, verify: float, draft: float, plain: float) -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return tokens * plain / (k * draft + verify)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--draft", help="a draft model's shape: its one-token step is timed too")
    p.add_argument(
        "--mtp", action="store_true", help="time the shape's MTP layer's round (as a draft's step)"
    )
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the steps")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="append the JSON line to this file")
    args = p.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)

    def measure(shape: str, ks) -> dict[int, float]:
        """Per k, a step's time on an engine built for k (its verify graphs hold 1 + k rows)."""
        model, tokenizer = load_shape(shape, dtype, device)
        blocks = (args.context + 1024) // 16 * 4 + 8
        times = {}
        for k in ks:
            spec = {"speculative": "ngram", "num_speculative_tokens": k} if k else {}
            config = build_config(max_num_seqs=8, num_blocks=blocks, **spec)
            engine = Engine(model, tokenizer, config, device)
            times[k] = step_ms(engine, k, args.context, args.repeats)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return times

    verify = measure(args.shape, KS)
    record = {
        "command": " ".join(["python", *sys.argv]),
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "context": args.context,
        "step_ms": verify,
        "verify_over_plain": {k: verify[k] / verify[0] for k in KS},
    }
    if args.mtp:
        model, tokenizer = load_shape(args.shape, dtype, device, mtp=True)
        config = build_config(max_num_seqs=8, speculative="mtp", num_speculative_tokens=2)
        draft = mtp_round_ms(Engine(model, tokenizer, config, device), args.context, args.repeats)
        record["draft"], record["draft_step_ms"] = "mtp", draft
    elif args.draft:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        draft = measure(args.draft, (0,))[0]
        record["draft"], record["draft_step_ms"] = args.draft, draft
    if args.mtp or args.draft:
        record["draft_speedup"] = {
            f"a={a}": {k: speedup(a, k, verify[k], draft, verify[0]) for k in KS if k}
            for a in (0.5, 0.6, 0.7, 0.8, 0.9)
        }
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
