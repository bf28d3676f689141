"""What the prefix cache's host tier (--kv-offloading-size) buys multi-turn chat when the KV pool
cannot hold every conversation: the same conversations with and without the tier, in one run.

    python benchmarks/host_tier_turns.py -o benchmarks/results/cpu-host-tier-turns-COMMIT.jsonl
    python benchmarks/host_tier_turns.py --device cuda --shape llama3-8b --conversations 32 \\
        --system-tokens 1024 --turn-tokens 256 --output-tokens 32 --block-size 64 \\
        --kv-offloading-size 16 -o benchmarks/results/h100-host-tier-turns-COMMIT.jsonl

--conversations conversations of --turns turns share a system prompt of --system-tokens token
ids; each turn adds --turn-tokens ids and resends the history (every earlier turn with its
greedy answer), as chat clients do. Turns go round robin (turn t of every conversation, then
turn t + 1), one request at a time, so a turn's time to first token is its prefill alone and,
with a pool of --pool-fraction of what every conversation's history needs, a conversation's
blocks are evicted by the others before its next turn. Two engines run the same conversations,
one without the tier and one with it, taking turns request by request (so load from elsewhere
on the machine falls on both alike).

One JSON line per run (TTFT p50 per turn; prefix hits per tier), then one of the ratios: the later
turns' TTFT p50 with the tier over without it (the issue's bar: at most 0.5), and whether every
turn's greedy tokens are the same.
"""

import argparse
import contextlib
import math
import random
import sys
import time

import torch

from kestrel import LLM, SamplingParams
from kestrel.bench.offline import emit, environment
from kestrel.bench.serve import percentile


def conversations(args) -> list[list[int]]:
    """Each conversation's first prompt: the shared system prompt, then its first user turn."""
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(100, 1000) for _ in range(n)]  # noqa: E731
    system = ids(args.system_tokens)
    return [system + ids(args.turn_tokens) for _ in range(args.conversations)]


def pool_blocks(args) -> int:
    """--pool-fraction of the blocks every conversation's last turn needs (+ the scratch
    block), and never less than one conversation needs alone."""
    longest = args.system_tokens + args.turns * (args.turn_tokens + args.output_tokens)
    per_conversation = math.ceil(longest / args.block_size) + 1
    wanted = int(args.pool_fraction * args.conversations * per_conversation)
    return max(wanted, per_conversation + 2) + 1


def first_token_and_answer(llm: LLM, request_id: str, prompt: list[int], args):
    """(seconds to the first token, the greedy answer) of one request run alone."""
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    engine, answer, ttft = llm.engine, [], None
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            answer += out.new_token_ids
            if ttft is None and answer:
                ttft = time.perf_counter() - start
    return ttft, answer


def run_turns(engines: list[LLM], args) -> tuple[list, list]:
    """Every conversation's turns on each engine, the engines taking turns request by request
    (the one that goes first alternates), so a noisy machine slows both alike. Per engine: per
    turn, each conversation's TTFT; and every answer in the order they ran."""
    rng = random.Random(f"{args.seed}-turns")
    history = conversations(args)
    ttft = [[[] for _ in range(args.turns)] for _ in engines]
    answers = [[] for _ in engines]
    for turn in range(args.turns):
        for c, prompt in enumerate(history):
            order = list(range(len(engines)))[:: 1 if (turn + c) % 2 == 0 else -1]
            for e in order:
                request_id = f"t{turn}-c{c}"
                seconds, answer = first_token_and_answer(engines[e], request_id, prompt, args)
                ttft[e][turn].append(seconds)
                answers[e].append(answer)
            user = [rng.randrange(100, 1000) for _ in range(args.turn_tokens)]
            history[c] = prompt + answers[0][-1] + user  # the history the first engine answered
    return ttft, answers


def engine(args, offloading: float) -> LLM:
    """An engine over a pool of `pool_blocks` blocks, with a host tier of `offloading` GiB."""
    settings = dict(progress=False, device=args.device, dtype=args.dtype)
    llm = LLM(
        args.model,
        shape=args.shape,
        block_size=args.block_size,
        num_blocks=pool_blocks(args),
        max_num_seqs=1,
        kv_offloading_size=offloading,
        **settings,
    )
    first_token_and_answer(llm, "warm-up", list(range(100, 164)), args)
    return llm


def record(llm: LLM, args, offloading: float, ttft: list[list[float]]) -> dict:
    """One engine's JSON line."""
    load = llm.engine.snapshot()
    return {
        "mode": "host-tier-turns",
        **environment(llm.device),
        "command": " ".join(["python benchmarks/host_tier_turns.py", *sys.argv[1:]]),
        "model": args.shape or args.model,
        "kv_offloading_size_gib": offloading,
        "pool_blocks": pool_blocks(args) - 1,
        "host_blocks": load.prefix_host_capacity,
        **{k: getattr(args, k) for k in ("conversations", "turns", "block_size")},
        **{k: getattr(args, k) for k in ("system_tokens", "turn_tokens", "output_tokens")},
        "per_turn_ttft_p50_s": [percentile(t, 50) for t in ttft],
        "later_turns_ttft_p50_s": percentile([s for t in ttft[1:] for s in t], 50),
        "prompt_tokens": load.prefix_queried_tokens,
        "hit_tokens_device": load.prefix_hit_tokens - load.prefix_host_hit_tokens,
        "hit_tokens_host": load.prefix_host_hit_tokens,
        "prefix_evictions": load.prefix_evictions,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--shape", help="random weights of a named shape instead of --model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=32)
    p.add_argument("--turn-tokens", type=int, default=96)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.2)
    p.add_argument("--kv-offloading-size", type=float, default=0.25, help="GiB, the tier's run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, help="torch's intra-op threads (a shared CPU: 1 waits less)"
    )
    p.add_argument("-o", "--output", help="append the JSON lines to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [0, args.kv_offloading_size]
    engines = [engine(args, size) for size in sizes]
    ttft, answers = run_turns(engines, args)
    with open(args.output, "a") if args.output else contextlib.nullcontext() as out:
        without, tiered = (
            record(e, args, size, t) for e, size, t in zip(engines, sizes, ttft, strict=True)
        )
        emit(without, out)
        emit(tiered, out)
        ratio = tiered["later_turns_ttft_p50_s"] / without["later_turns_ttft_p50_s"]
        emit(
            {
                "mode": "host-tier-turns-ratio",
                **{k: tiered[k] for k in ("commit", "device", "gpu", "command")},
                "later_turns_ttft_p50_ratio": ratio,
                "tokens_match": answers[0] == answers[1],
            },
            out,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
