"""Disaggregated prefill and decode on the CPU: a prefill engine process and a decode engine
process of the embedded SmolLM2, the KV handed over gloo, behind the P/D router, give the tokens,
text and finish reasons one engine gives (greedy, a stop string mid-way, a seeded sampled
request), and a request aborted while it prefills leaves the later hand-offs intact."""

import asyncio
from dataclasses import replace

import pytest

from kestrel.config import build_config
from kestrel.engine.client import GenerateRequest
from kestrel.llm import load_engine
from kestrel.sampling import SamplingParams
from kestrel.server.main import build_engine, load_frontend
from kestrel.server.pd_router import load_disaggregated
from kestrel.tokenizer import apply_chat_template

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
]
CONFIG = build_config(model="smollm2", device="cpu", ctx_size=1024, max_num_seqs=4, threads=1)


@pytest.fixture(scope="module")
def pair():
    """(the P/D router over its two engine processes, its event loop)."""
    config = replace(CONFIG, parallel=replace(CONFIG.parallel, disaggregate=True))
    tokenizer, processor = load_frontend(config)
    client = load_disaggregated(config, build_engine, "warning", tokenizer, processor)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(client.start())
    yield client, loop
    client.stop()
    loop.run_until_complete(asyncio.sleep(0))  # the readers' cancellations run
    loop.close()


@pytest.fixture(scope="module")
def engine():
    """One whole engine of the same model: the reference."""
    engine, _ = load_engine(CONFIG, progress=False)
    return engine


def prompts(tokenizer) -> list[list[int]]:
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def run_engine(engine, requests: list[GenerateRequest]) -> dict[str, tuple]:
    """request id -> (tokens, text, finish reason) from the whole engine."""
    results = {r.request_id: ([], [], None) for r in requests}
    for r in requests:
        engine.add_request(r.request_id, r.prompt, r.params)
    while engine.has_unfinished():
        for output in engine.step():
            tokens, text, _ = results[output.request_id]
            tokens += output.new_token_ids
            text.append(output.new_text)
            results[output.request_id] = (tokens, text, output.finish_reason)
    return {i: (tokens, "".join(text), reason) for i, (tokens, text, reason) in results.items()}


def run_pair(pair, requests: list[GenerateRequest]) -> dict[str, tuple]:
    client, loop = pair

    async def collect():
        results = {r.request_id: ([], [], None) for r in requests}
        async for output in await client.add(requests):
            assert output.error is None, output.error
            tokens, text, _ = results[output.request_id]
            tokens += output.new_token_ids
            text.append(output.new_text)
            results[output.request_id] = (tokens, text, output.finish_reason)
        return {i: (t, "".join(x), reason) for i, (t, x, reason) in results.items()}

    return loop.run_until_complete(collect())


def requests_of(prompts_ids, params: SamplingParams, tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(f"{tag}{i}", ids, params) for i, ids in enumerate(prompts_ids)]


def test_the_pair_gives_the_greedy_tokens_of_one_engine(pair, engine):
    requests = requests_of(
        prompts(engine.tokenizer), SamplingParams(max_tokens=32, temperature=0), "g"
    )
    before = pair[0].handed_off
    got, want = run_pair(pair, requests), run_engine(engine, requests)
    assert got == want
    assert pair[0].handed_off - before == len(
        requests
    )  # every one was decoded by the decode engine
    assert any(reason == "length" for _, _, reason in got.values())


def test_a_stop_string_mid_way_ends_the_pair_as_one_engine(pair, engine):
    ids = prompts(engine.tokenizer)[:1]
    free = run_engine(engine, requests_of(ids, SamplingParams(max_tokens=24, temperature=0), "f"))
    text = free["f0"][1]
    # a stop string starting at the first token (held back by the prefill engine) and one later
    for stop in (text[: len(text.split()[0]) + 3], text.split()[3]):
        params = SamplingParams(max_tokens=24, temperature=0, stop=[stop])
        requests = requests_of(ids, params, f"s{len(stop)}-")
        got, want = run_pair(pair, requests), run_engine(engine, requests)
        assert got == want
        assert next(iter(got.values()))[2] == "stop"


def test_a_seeded_sampled_request_draws_as_in_one_engine(pair, engine):
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    requests = requests_of(prompts(engine.tokenizer)[1:3], params, "seeded")
    assert run_pair(pair, requests) == run_engine(engine, requests)


def test_an_abort_while_prefilling_leaves_later_hand_offs_intact(pair, engine):
    client, loop = pair
    ids = prompts(engine.tokenizer)
    greedy = SamplingParams(max_tokens=8, temperature=0)

    async def abort_one():
        stream = await client.add(requests_of(ids[:1], greedy, "aborted"))
        client.abort(stream)

    loop.run_until_complete(abort_one())
    requests = requests_of(ids[2:], greedy, "after")
    assert run_pair(pair, requests) == run_engine(engine, requests)


def test_one_token_requests_finish_in_the_prefill_engine(pair, engine):
    requests = requests_of(
        prompts(engine.tokenizer), SamplingParams(max_tokens=1, temperature=0), "one"
    )
    before = pair[0].handed_off
    got = run_pair(pair, requests)
    assert got == run_engine(engine, requests)
    assert pair[0].handed_off == before
