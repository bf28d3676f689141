"""Soak test: a bounded mixed load on a real `kestrel serve`, reported per window.

    .venv/bin/python benchmarks/soak.py                      # 10 minutes on smollm2
    .venv/bin/python benchmarks/soak.py --duration 240 --out benchmarks/results/soak.json

`--concurrency` clients loop over requests: streamed and non-streamed chat/completions, 10% of
streams cancelled mid-stream by the client, 1% malformed (they must get 400). The k-th request
sent is of the same kind on every machine (one seeded sequence for all clients), and
`--min-requests` keeps the load on past `--duration` until that many were sent: a short soak on a
slow machine still sends the same mix. Every request is classified, once: completed
(finish_reason seen), errored explicitly (an OpenAI error body or event, or 503 + Retry-After),
cancelled (by us), rejected (malformed: 400), or unexpected (anything else: a 5xx other than 503,
a reset, a hang); one still in flight when the time is up counts in the last window. Each window
reports counts, p50/p99 latency of completed requests, the server's RSS and mean KV tokens in
use; at the end the server must go idle (no running or waiting request, KV in use back to its
starting value) and stay healthy.

Pass: no unexpected outcome, every accepted request completed or errored explicitly, RSS drift and
idle-KV drift under 5%, p99 drift under 20%. Drift compares the last window with the first one
after a warm-up window (allocator pools and caches fill during the first).
"""

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_fixtures import start_server  # noqa: E402

OUTCOMES = ("completed", "errored", "cancelled", "rejected", "unexpected")
TOPICS = ["rivers", "falcons", "the moon", "bread", "glaciers", "trains", "owls", "tea"]


@dataclass
class Window:
    index: int
    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    latencies: list = field(default_factory=list)
    rss_mib: float = 0.0
    kv_samples: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "window": self.index,
            **self.counts,
            "p50_s": _pct(lat, 50),
            "p99_s": _pct(lat, 99),
            "rss_mib": round(self.rss_mib, 1),
            "kv_tokens_mean": round(statistics.fmean(self.kv_samples), 1) if self.kv_samples else 0,
            "unexpected_examples": self.unexpected[:3],
        }


def _pct(values: list, p: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * p / 100))], 4)


class Soak:
    def __init__(self, url: str, model: str, headers: dict, args):
        self.url, self.model, self.headers, self.args = url, model, headers, args
        self.windows: list[Window] = []
        self.started = 0.0
        self.sent = 0
        self.kinds = random.Random(args.seed)  # one sequence of request kinds for all clients

    def running(self) -> bool:
        elapsed = time.monotonic() - self.started
        return elapsed < self.args.duration or self.sent < self.args.min_requests

    def window(self) -> Window:
        last = max(0, math.ceil(self.args.duration / self.args.window) - 1)
        index = min(last, int((time.monotonic() - self.started) // self.args.window))
        while len(self.windows) <= index:
            self.windows.append(Window(len(self.windows)))
        return self.windows[index]

    def record(self, outcome: str, latency: float, detail: str = "") -> None:
        window = self.window()
        window.counts[outcome] += 1
        if outcome == "completed":
            window.latencies.append(latency)
        if outcome == "unexpected":
            window.unexpected.append(detail[:200])

    async def client_loop(self, client: httpx.AsyncClient, rng: random.Random):
        while self.running():
            roll = self.kinds.random()
            self.sent += 1
            started = time.monotonic()
            try:
                if roll < 0.01:
                    outcome, detail = await self.malformed(client, rng)
                elif roll < 0.11:
                    outcome, detail = await self.stream(client, rng, cancel_after=rng.randint(1, 6))
                elif roll < 0.6:
                    outcome, detail = await self.stream(client, rng)
                else:
                    outcome, detail = await self.plain(client, rng)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
                outcome, detail = "unexpected", repr(error)
            self.record(outcome, time.monotonic() - started, detail)

    def body(self, rng: random.Random, stream: bool) -> tuple[str, dict]:
        topic = rng.choice(TOPICS)
        common = {"model": self.model, "max_tokens": self.args.max_tokens, "stream": stream}
        common["temperature"] = rng.choice([0, 0.7, 1.0])
        if rng.random() < 0.5:
            messages = [{"role": "user", "content": f"Write two sentences about {topic}."}]
            return "/v1/chat/completions", {**common, "messages": messages}
        return "/v1/completions", {**common, "prompt": f"A short note about {topic}:"}

    async def plain(self, client, rng) -> tuple[str, str]:
        path, body = self.body(rng, stream=False)
        response = await client.post(self.url + path, json=body)
        return _classify(response, lambda: response.json()["choices"][0]["finish_reason"])

    async def stream(self, client, rng, cancel_after: int | None = None) -> tuple[str, str]:
        path, body = self.body(rng, stream=True)
        async with client.stream("POST", self.url + path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _classify(response, lambda: None)
            events, finished = 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return ("completed", "") if finished else ("unexpected", "[DONE] early")
                event = json.loads(line[6:])
                if "error" in event:
                    return "errored", event["error"]["message"]
                events += 1
                finished |= any(c.get("finish_reason") for c in event.get("choices", []))
                if cancel_after is not None and events >= cancel_after:
                    return "cancelled", ""  # leaving the block drops the connection
            return "unexpected", "stream ended without [DONE]"

    async def malformed(self, client, rng) -> tuple[str, str]:
        bad = rng.choice(
            [
                b"{not json",
                b"[]",
                b'{"model": 5}',
                b'{"messages": [], "model": "x"}',
                json.dumps(
                    {
                        "model": self.model,
                        "messages": [{"role": "user", "content": "hi"}],
                        "temperature": -3,
                    }
                ).encode(),
            ]
        )
        response = await client.post(
            self.url + "/v1/chat/completions",
            content=bad,
            headers={"Content-Type": "application/json"},
        )
        if response.status_code == 400 and response.json()["error"]["type"]:
            return "rejected", ""
        return "unexpected", f"malformed body got {response.status_code}"


def _classify(response: httpx.Response, finish) -> tuple[str, str]:
    if response.status_code == 200:
        return ("completed", "") if finish() else ("unexpected", "no finish_reason")
    if response.status_code == 503 and response.headers.get("retry-after"):
        return "errored", "503 overloaded"
    try:
        error = response.json()["error"]
        if response.status_code < 500 or response.status_code in (500, 503):
            return "errored", f"{response.status_code} {error['message']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        pass
    return "unexpected", f"{response.status_code} {response.text[:120]}"


def _metrics(url: str, headers: dict) -> dict:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _monitor(soak: Soak, pid: int) -> None:
    while soak.running():
        window = soak.window()
        metrics = await asyncio.to_thread(_metrics, soak.url, soak.headers)
        window.kv_samples.append(metrics["kestrel_kv_tokens_in_use"])
        window.rss_mib = _rss_mib(pid)
        await asyncio.sleep(1.0)


async def _run(soak: Soak, pid: int) -> None:
    soak.started = time.monotonic()
    limits = httpx.Limits(max_connections=soak.args.concurrency + 4)
    async with httpx.AsyncClient(headers=soak.headers, timeout=120, limits=limits) as client:
        rngs = [random.Random(soak.args.seed + i) for i in range(soak.args.concurrency)]
        await asyncio.gather(_monitor(soak, pid), *(soak.client_loop(client, rng) for rng in rngs))


def _wait_idle(url: str, headers: dict, timeout: float = 60.0) -> dict:
    """The metrics once idle (or at the deadline: a hang guard, returned as soon as it is idle)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url, headers)
        idle = m["kestrel_running_sequences"] == m["kestrel_queue_depth"] == 0
        if (idle and m["kestrel_kv_tokens_in_use"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _drift(first, last) -> float | None:
    if first is None or last is None or first == 0:
        return None if first != last else 0.0
    return round((last - first) / first, 4)


def report(soak: Soak, kv_idle_start: float, end_metrics: dict, healthy: bool, args) -> dict:
    windows = [w.summary() for w in soak.windows]
    totals = {k: sum(w[k] for w in windows) for k in OUTCOMES}
    first = windows[1] if len(windows) > 2 else windows[0]  # after the warm-up window
    last = windows[-1]
    drift = {
        "rss": _drift(first["rss_mib"], last["rss_mib"]),
        "kv_idle_tokens": end_metrics["kestrel_kv_tokens_in_use"] - kv_idle_start,
        "p99": _drift(first["p99_s"], last["p99_s"]),
        "compared_windows": [first["window"], last["window"]],
    }
    idle = end_metrics["kestrel_running_sequences"] == end_metrics["kestrel_queue_depth"] == 0
    checks = {
        "no_unexpected": totals["unexpected"] == 0,
        "idle_at_end": idle and drift["kv_idle_tokens"] == 0,
        "healthy_at_end": healthy,
        "rss_drift_under_5pct": drift["rss"] is not None and abs(drift["rss"]) < 0.05,
        "p99_drift_under_20pct": drift["p99"] is not None and drift["p99"] < 0.20,
    }
    return {
        "config": vars(args),
        "duration_s": args.duration,
        "requests": soak.sent,
        "totals": totals,
        "accepted": totals["completed"] + totals["errored"] + totals["cancelled"],
        "windows": windows,
        "drift": drift,
        "checks": checks,
        "passed": all(checks.values()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600, help="seconds of load (default 10 min)")
    p.add_argument("--window", type=float, default=60, help="report window in seconds")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="keep the load on past --duration until this many requests were sent",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-m", "--model", default="smollm2", help="served model (kestrel serve -m)")
    p.add_argument("--server-args", default="-np 8 -c 1024", help="more kestrel serve flags")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)

    server = start_server(["-m", args.model, "-a", "soak", *args.server_args.split()])
    try:
        headers = {}
        kv_idle_start = _wait_idle(server.url, headers)["kestrel_kv_tokens_in_use"]
        soak = Soak(server.url, "soak", headers, args)
        asyncio.run(_run(soak, server.process.pid))
        end_metrics = _wait_idle(server.url, headers)
        healthy = server.get("/health")[0] == 200
        result = report(soak, kv_idle_start, end_metrics, healthy, args)
        result["server_exit_code"] = server.stop()
    finally:
        server.stop()
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for w in result["windows"]:
        print(json.dumps({k: v for k, v in w.items() if k != "unexpected_examples"}))
    print(
        json.dumps(
            {k: result[k] for k in ("requests", "totals", "accepted", "drift", "checks", "passed")}
        )
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
