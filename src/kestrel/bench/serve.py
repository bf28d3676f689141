"""`kestrel bench serve --url URL`: any OpenAI-compatible server under N concurrent clients.

Each client streams completions (`/v1/completions`, or `/v1/chat/completions` with text prompts)
through httpx, asking for exactly --output-tokens (`max_tokens` + `ignore_eos`, greedy). Per
request: TTFT (send -> first chunk with text or a finish reason), ITL (gaps between such chunks) and TPOT
((latency - TTFT) / (output tokens - 1)); output tokens come from the server's `usage` (the
stream's last chunk) and fall back to the chunk count. One JSON line per concurrency level.
"""

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

# common short English words: about one token each with most tokenizers, after a space
WORDS = (
    "the of and to in is was for on are with as by at be this from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may "
    "then do first any my now such like our over man me even most made after also did many"
).split()


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # what the server streamed (multi-turn sends it back as the history)


def make_prompts(args) -> list:
    """Token-id lists or texts; --prompts fixed repeats request 0's prompt for every request."""
    rng = random.Random(args.seed)
    prompts = []
    for i in range(args.num_requests):
        if i and args.prompts == "fixed":
            prompts.append(prompts[0])
            continue
        p = args.prompt_tokens
        n = rng.randint(max(1, p // 2), p * 3 // 2) if args.random_lengths else p
        if args.prompt_format == "ids":
            low = min(100, args.vocab_size // 2)
            prompts.append([rng.randrange(low, args.vocab_size) for _ in range(n)])
        else:
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(n)))
    return prompts


def request_body(args, model: str, prompt, max_tokens: int, **extra) -> tuple[str, dict]:
    """The streamed request of one prompt: token ids or text (completions), a text or a list of
    chat messages (chat); `extra` joins the body."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,  # vLLM, SGLang and kestrel honour it; others stop at EOS
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if prompt and isinstance(prompt[0], dict):
        return "/v1/chat/completions", {**body, "messages": prompt}
    if args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _content(chunk: dict) -> str | None:
    """The generated text a stream chunk carries, or "" for the end of a choice; None for a
    role-only first chat chunk (sent before any token) or the usage-only last one. A finish
    chunk counts because a server may hold text back (an incomplete UTF-8 character, a special
    token) until then."""
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            return text
        if choice.get("finish_reason"):
            return ""
    return None


async def one_request(client, args, model: str, prompt, max_tokens: int, **extra) -> Result:
    path, body = request_body(args, model, prompt, max_tokens, **extra)
    result, chunks, last = Result(), 0, None
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if (text := _content(chunk)) is not None:
                    result.text += text
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
    except Exception as error:  # a refused or dropped connection counts as a failed request
        result.error = f"{type(error).__name__}: {error}"[:200]
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no content in the stream"
    return result


async def run_level(client, args, model: str, prompts: list, concurrency: int) -> tuple:
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), disable=args.no_progress, unit="req", leave=False)

    async def limited(prompt):
        async with gate:
            result = await one_request(client, args, model, prompt, args.output_tokens)
        bar.update(1)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    elapsed = time.perf_counter() - start
    bar.close()
    return results, elapsed


def summarize(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl]
    record = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "elapsed_s": elapsed,
        "generated_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        "request_s": len(ok) / elapsed,
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(1, len(ok)),
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl)):
        record[f"{name}_mean_s"] = sum(values) / len(values) if values else None
        record[f"{name}_p50_s"] = percentile(values, 50)
        record[f"{name}_p99_s"] = percentile(values, 99)
    errors = [r.error for r in results if r.error]
    if errors:
        record["first_error"] = errors[0]
    return record


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    values = sorted(values)
    rank = (len(values) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)


async def served_model(client, args) -> str:
    """--served-model, or the first id /v1/models lists, once /health (where the server has
    one) says ready; waits up to --wait seconds for that."""
    import httpx

    deadline = time.monotonic() + args.wait
    while True:
        try:
            health = await client.get("/health")  # 503 while loading (kestrel, llama-server)
            response = await client.get("/v1/models")
            if response.status_code == 200 and health.status_code in (200, 404):
                return args.served_model or response.json()["data"][0]["id"]
            problem = f"HTTP {health.status_code}/{response.status_code}: {response.text[:200]}"
        except httpx.TransportError as error:
            problem = repr(error)
        if time.monotonic() >= deadline:
            raise SystemExit(f"no server answers at {args.url}: {problem}")
        await asyncio.sleep(0.5)


def http_client(args):
    import httpx

    levels = args.concurrency
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    return httpx.AsyncClient(
        base_url=args.url.rstrip("/"), headers=headers, limits=limits, timeout=timeout
    )


async def bench_serve(args, emit_record) -> None:
    levels = args.concurrency
    async with http_client(args) as client:
        model = await served_model(client, args)
        prompts = make_prompts(args)
        for _ in range(args.warmup):  # connections and first-request work out of the numbers
            warm = await one_request(client, args, model, prompts[0], 4)
            if not warm.ok:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        for concurrency in levels:
            results, elapsed = await run_level(client, args, model, prompts, concurrency)
            emit_record(
                {
                    "engine": "server",
                    "url": args.url,
                    "model": model,
                    "mode": "serve",
                    "endpoint": args.endpoint,
                    "prompt_format": args.prompt_format,
                    "prompts": args.prompts,
                    "num_requests": args.num_requests,
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                    "random_lengths": args.random_lengths,
                    "concurrency": concurrency,
                    **summarize(results, elapsed),
                }
            )


def add_serve_bench_args(p) -> None:
    g = p.add_argument_group("bench serve (an OpenAI-compatible server at --url)")
    g.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8080")
    g.add_argument(
        "--concurrency", type=int, nargs="+", default=[64], help="clients at once (one run each)"
    )
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="prompts as token ids (completions) or text of --prompt-tokens words",
    )
    g.add_argument(
        "--prompts",
        choices=["random", "fixed"],
        default="random",
        help="a different random prompt per request, or one prompt for all",
    )
    g.add_argument(
        "--vocab-size", type=int, default=32000, help="random token ids are drawn below this"
    )
    g.add_argument("--served-model", help="the `model` field (default: the first /v1/models id)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for the server to answer"
    )
    m = p.add_argument_group("bench serve --multi-turn (chat conversations resending history)")
    m.add_argument("--multi-turn", action="store_true", help="conversations instead of prompts")
    m.add_argument("--conversations", type=int, default=16)
    m.add_argument("--turns", type=int, default=8)
    m.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt")
    m.add_argument("--turn-tokens", type=int, default=200, help="each user message")
    m.add_argument(
        "--compare-no-cache",
        action="store_true",
        help='first run with "cache_prompt": false (kestrel, llama-server), then cached',
    )
