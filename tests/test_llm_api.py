"""The vLLM-shaped Python API on the real SmolLM2: results, batching, seeds, stops, KV bounds."""

import pytest

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequestError

PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", progress=False, max_num_seqs=4, prefill_chunk_size=8)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_batched_prompts_equal_each_alone(llm):
    batched = [r.outputs[0].text for r in llm.generate(PROMPTS, greedy())]
    alone = [llm.generate(p, greedy())[0].outputs[0].text for p in PROMPTS]
    assert batched == alone and all(batched)


def test_result_shape_and_logprobs(llm):
    result = llm.generate("Hello", greedy(max_tokens=5, logprobs=3))[0]
    out = result.outputs[0]
    assert result.prompt_token_ids == llm.tokenizer("Hello")["input_ids"]
    assert len(out.token_ids) == len(out.logprobs) == 5 and out.finish_reason == "length"
    for token, logprobs in zip(out.token_ids, out.logprobs, strict=True):
        assert token in logprobs and len(logprobs) == 3  # greedy: the sampled token is the top one
        assert max(logprobs, key=logprobs.get) == token


def test_token_id_prompt_equals_text_prompt(llm):
    ids = llm.tokenizer("Once upon a time")["input_ids"]
    assert (
        llm.generate(ids, greedy())[0].outputs[0].text
        == llm.generate("Once upon a time", greedy())[0].outputs[0].text
    )


def test_seed_reproduces_and_n_gives_distinct_choices(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8)
    first = [o.text for o in llm.generate("Tell me a story", params)[0].outputs]
    second = [o.text for o in llm.generate("Tell me a story", params)[0].outputs]
    assert first == second and len(set(first)) > 1


def test_stop_string_ends_generation(llm):
    full = llm.generate("1, 2, 3, 4,", greedy(max_tokens=16))[0].outputs[0].text
    assert " 7" in full
    out = llm.generate("1, 2, 3, 4,", greedy(max_tokens=16, stop=[" 7"]))[0].outputs[0]
    assert out.text == full[: full.index(" 7")] and out.finish_reason == "stop"


def test_kv_bound_generation_runs_past_the_bound():
    small = LLM("smollm2", progress=False, max_kv_size=32, keep=4, prefill_chunk_size=16)
    prompt = "Count: " + ", ".join(str(i) for i in range(40))
    out = small.generate(prompt, greedy(max_tokens=20))[0].outputs[0]
    assert len(out.token_ids) == 20
    assert small.engine.scheduler.blocks.tokens_trimmed > 0


def test_prompt_longer_than_context_is_refused():
    small = LLM("smollm2", progress=False, ctx_size=16)
    with pytest.raises(InvalidRequestError) as error:
        small.generate("word " * 40, greedy())
    assert error.value.code == "context_length_exceeded"
    # max_tokens is clamped to what fits
    out = small.generate("Hi", greedy(max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16


def test_priority_needs_the_priority_policy_and_one_value_per_prompt(llm):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(PROMPTS[:2], greedy(), priority=[0, 3])  # fcfs: only 0 (vLLM's 400)
    assert error.value.param == "priority"
    assert not llm.engine.has_unfinished()  # the first prompt was not left queued
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(PROMPTS[:2], greedy(), priority=[0])
    assert error.value.param == "priority"


def test_priority_policy_runs_the_lower_value_first_with_the_same_tokens(llm):
    ranked = LLM(
        "smollm2",
        progress=False,
        max_num_seqs=1,
        prefill_chunk_size=8,
        scheduling_policy="priority",
    )
    texts = [r.outputs[0].text for r in ranked.generate(PROMPTS, greedy(), priority=[3, 1, 2, 0])]
    assert texts == [r.outputs[0].text for r in llm.generate(PROMPTS, greedy())]
    for i, rank in enumerate([5, 0]):  # one slot: the later, lower value runs first
        ranked.engine.add_request(f"p{i}", PROMPTS[i], greedy(max_tokens=2), priority=rank)
    finished = []
    while ranked.engine.has_unfinished():
        finished += [o.request_id for o in ranked.engine.step() if o.finished]
    assert finished == ["p1", "p0"]
