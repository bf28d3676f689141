"""Automatic prefix caching through the real server on SmolLM2 with the `openai` client: a
conversation's later turns reuse the KV of the earlier ones, report it as OpenAI does
(`usage.prompt_tokens_details.cached_tokens`) and in /metrics, and answer exactly as a recomputed
prompt does (`cache_prompt: false`, llama-server's opt-out)."""

import pytest

from kestrel.llm import LLM
from kestrel.sampling import SamplingParams
from server_fixtures import start_server

MODEL = "smollm2"
SYSTEM = "You are a terse assistant. " + " ".join(
    f"Rule {i}: answer in at most {i + 3} words and never mention rule {i * 7 % 11}."
    for i in range(24)
)


@pytest.fixture(scope="module")
def server():
    server = start_server(["-m", MODEL, "--block-size", "16"])
    yield server
    server.stop()


def _chat(client, messages, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra or None
    )


def test_a_later_turn_reuses_the_earlier_turns_and_answers_as_a_recomputed_prompt(server):
    client = server.client()
    before = server.metrics()
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi, who are you?"},
    ]
    first = _chat(client, messages)
    assert first.usage.prompt_tokens > 300
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what is two plus two?"},
    ]
    second = _chat(client, messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # every whole block of the first turn's prompt is reused (blocks of 16 tokens)
    assert first.usage.prompt_tokens - 16 < cached < second.usage.prompt_tokens
    recomputed = _chat(client, messages, cache_prompt=False)
    assert recomputed.usage.prompt_tokens_details.cached_tokens == 0
    assert recomputed.choices[0].message.content == second.choices[0].message.content
    after = server.metrics()
    device = 'kestrel_prefix_cache_hits_total{tier="device"}'
    hits = after[device] - before[device]
    queries = (
        after["kestrel_prefix_cache_queries_total"] - before["kestrel_prefix_cache_queries_total"]
    )
    assert hits == cached  # the opted-out request was not looked up
    assert queries == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert after["kestrel_prefix_cache_blocks"] > 0
    assert after['kestrel_prefix_cache_hits_total{tier="host"}'] == 0  # no host tier by default


def test_a_streamed_answer_reports_its_cached_tokens_in_the_usage_chunk(server):
    client = server.client()
    prompt = SYSTEM + " Now count from one to five:"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens - 16 <= usage[0].prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_prefix_caching_recomputes_every_prompt(prefix_caching):
    llm = LLM(MODEL, progress=False, prefix_caching=prefix_caching, block_size=16)
    params = SamplingParams(max_tokens=4, temperature=0)
    answers = [llm.generate([SYSTEM], params)[0].outputs[0].token_ids for _ in range(2)]
    assert answers[0] == answers[1]
    hits = llm.engine.snapshot().prefix_hit_tokens
    assert hits > 300 if prefix_caching else hits == 0


def _conversations(llm: LLM, turns: int) -> list[list[int]]:
    """6 conversations sharing a system prompt, each turn batched: every answer's tokens."""
    system = SYSTEM[: len(SYSTEM) // 3]
    histories = [f"{system} Conversation {c}." for c in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    answers = []
    for turn in range(turns):
        histories = [f"{h}\nUser: say something about {turn}.\nAssistant:" for h in histories]
        results = llm.generate(histories, params)
        histories = [h + r.outputs[0].text for h, r in zip(histories, results, strict=True)]
        answers += [r.outputs[0].token_ids for r in results]
    return answers


def test_under_memory_pressure_cached_blocks_are_evicted_and_no_request_fails():
    # 24 blocks of 16 tokens: 3 running conversations of ~140 tokens fill most of it, so the
    # blocks the other conversations left cached are evicted as the turns go on
    small = dict(num_blocks=24, block_size=16, max_num_seqs=3, progress=False)
    cached = LLM(MODEL, **small)
    answers = _conversations(cached, turns=2)
    load = cached.engine.snapshot()
    assert load.prefix_evictions > 0 and load.prefix_hit_tokens > 0
    assert answers == _conversations(LLM(MODEL, prefix_caching=False, **small), turns=2)
