"""`kestrel bench serve --multi-turn`: what prefix caching buys a chat server.

--conversations chat conversations of --turns turns share one system prompt of --system-tokens
words; each turn adds a user message of --turn-tokens words and resends the whole history (the
system prompt, every earlier turn with the answer the server streamed, the new message), as chat
clients do. Conversations run at once, at most --concurrency (its first value) at a time, each
holding its client for all its turns. One record per run: TTFT p50/p99 per turn, throughput, and
the prompt tokens the server reported cached (`usage.prompt_tokens_details.cached_tokens`).

--compare-no-cache runs the workload twice in one invocation: first with `"cache_prompt": false`
in every request (kestrel and llama-server recompute such prompts), then as clients send them,
each run with its own system prompt so the second finds nothing of the first's cached; then a
record of the ratios. A server that ignores `cache_prompt` (vLLM) is measured by two
invocations instead, one against it started with its prefix caching off
(`--no-enable-prefix-caching`).
"""

import asyncio
import random
import time

from kestrel.bench.serve import WORDS, Result, http_client, one_request, percentile, served_model


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def conversation(client, args, model, system: str, index: int, extra: dict, bar):
    """One conversation's turns, in order; each turn's Result."""
    rng = random.Random(f"{args.seed}-{index}")
    messages = [{"role": "system", "content": system}]
    results = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.turn_tokens)})
        result = await one_request(client, args, model, messages, args.output_tokens, **extra)
        results.append(result)
        bar.update(1)
        if not result.ok:
            break  # the history would be wrong from here
        messages.append({"role": "assistant", "content": result.text})
    return results


async def run_conversations(client, args, model, cached: bool, run: int) -> tuple[list, float]:
    from tqdm import tqdm

    system = words(random.Random(f"{args.seed}-system-{run}"), args.system_tokens)
    extra = {} if cached else {"cache_prompt": False}
    gate = asyncio.Semaphore(args.concurrency[0])
    total = args.conversations * args.turns
    bar = tqdm(total=total, disable=args.no_progress, unit="turn", leave=False)

    async def limited(index):
        async with gate:
            return await conversation(client, args, model, system, index, extra, bar)

    start = time.perf_counter()
    conversations = await asyncio.gather(*(limited(i) for i in range(args.conversations)))
    elapsed = time.perf_counter() - start
    bar.close()
    return conversations, elapsed


def summarize_turns(conversations: list[list[Result]], elapsed: float) -> dict:
    """Per turn TTFT over the conversations; totals over every turn."""
    ok = [r for turns in conversations for r in turns if r.ok]
    turns = max(len(c) for c in conversations)
    per_turn = []
    for t in range(turns):
        ttft = [c[t].ttft for c in conversations if len(c) > t and c[t].ok]
        prompt = [c[t].prompt_tokens for c in conversations if len(c) > t and c[t].ok]
        per_turn.append(
            {
                "turn": t + 1,
                "completed": len(ttft),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "mean_prompt_tokens": sum(prompt) / max(1, len(prompt)),
            }
        )
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    failed = [r for turns in conversations for r in turns if not r.ok]
    record = {
        "completed": len(ok),
        "failed": len(failed),
        "elapsed_s": elapsed,
        "total_tok_s": (prompt + output) / elapsed,
        "output_tok_s": output / elapsed,
        "prompt_tokens": prompt,
        "cached_tokens": sum(reported) if reported else None,
        "later_turns_ttft_p50_s": percentile([r.ttft for c in conversations for r in c[1:]], 50),
        "per_turn": per_turn,
    }
    if failed:
        record["first_error"] = failed[0].error
    return record


def ratios(no_cache: dict, cache: dict) -> dict:
    """Cached over uncached: TTFT p50 of turns 2.. (lower is better) and total throughput."""

    def ratio(key):
        a, b = cache[key], no_cache[key]
        return a / b if a is not None and b else None

    return {
        "mode": "serve-multi-turn-ratios",
        "later_turns_ttft_p50_ratio": ratio("later_turns_ttft_p50_s"),
        "total_tok_s_ratio": ratio("total_tok_s"),
    }


async def bench_multi_turn(args, emit_record) -> None:
    async with http_client(args) as client:
        model = await served_model(client, args)
        warm = await one_request(client, args, model, [{"role": "user", "content": "hi"}], 4)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        runs = [False, True] if args.compare_no_cache else [True]
        records = {}
        for run, cached in enumerate(runs):
            conversations, elapsed = await run_conversations(client, args, model, cached, run)
            records[cached] = {
                "engine": "server",
                "url": args.url,
                "model": model,
                "mode": "serve-multi-turn",
                "prefix_caching": cached,
                "conversations": args.conversations,
                "turns": args.turns,
                "system_tokens": args.system_tokens,
                "turn_tokens": args.turn_tokens,
                "output_tokens": args.output_tokens,
                "concurrency": args.concurrency[0],
                **summarize_turns(conversations, elapsed),
            }
            emit_record(records[cached])
        if args.compare_no_cache:
            emit_record({"model": model, **ratios(records[False], records[True])})
