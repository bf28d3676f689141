"""llama-server's native routes on a real `kestrel serve` (smollm2), as llama-server's README
documents them and its clients use them: /props, /slots, /apply-template, /tokenize with pieces,
and /completion's token-id prompts, n_probs, timings, tokens, generation_settings, logit_bias
lists, stop words, several prompts and streaming. Plain HTTP (urllib, httpx), as those clients."""

import json

import httpx
import pytest

import kestrel
from server_fixtures import HANG_S, SMOLLM2_ARGS, shared_server, start_server, tiny_model

pytestmark = pytest.mark.slow

PROMPT = "The history of the Roman Empire"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def tokenizer():
    from kestrel.weights.loader import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2"))


def complete(server, **body) -> dict:
    status, reply = server.post("/completion", {"temperature": 0, "n_predict": 8, **body})
    assert status == 200, reply
    return reply


@pytest.fixture(scope="module")
def greedy(server) -> dict:
    """PROMPT's greedy continuation, with everything /completion can report."""
    return complete(server, prompt=PROMPT, n_probs=3, return_tokens=True)


def test_props_describe_the_server(server, tokenizer):
    status, props = server.get("/props")
    assert status == 200
    props = json.loads(props)
    assert props["total_slots"] == int(SMOLLM2_ARGS[SMOLLM2_ARGS.index("-np") + 1])
    assert props["model_path"] == "smollm2"
    assert props["chat_template"] == tokenizer.chat_template
    assert kestrel.__version__ in props["build_info"]
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 1024
    params = settings["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["n_predict"]) == (
        0.8,
        40,
        0.95,
        -1,
    )


def test_slots_are_501_unless_enabled(server):
    status, body = server.get("/slots")
    assert status == 501
    error = json.loads(body)["error"]
    assert error["type"] == "not_supported_error" and "--slots" in error["message"]


def test_slots_describe_the_idle_slots_when_enabled():
    server = start_server(["-m", tiny_model(), "-c", "4096", "-np", "1", "--slots"])
    try:
        [slot] = json.loads(server.get("/slots")[1])
        assert slot["is_processing"] is False and slot["n_ctx"] == 4096
        assert server.get("/slots?fail_on_no_slot=1")[0] == 200
    finally:
        server.stop()


def test_apply_template_gives_the_prompt_chat_completions_runs(server, tokenizer):
    status, reply = server.post("/apply-template", {"messages": MESSAGES})
    assert status == 200
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert reply["prompt"] == expected
    chat = server.client().chat.completions.create(
        model="smollm2", messages=MESSAGES, temperature=0, max_tokens=12
    )
    completion = complete(server, prompt=reply["prompt"], n_predict=12)
    assert completion["content"] == chat.choices[0].message.content


def test_tokenize_with_pieces_special_tokens_and_bytes(server, tokenizer):
    text = "Hello á 你好"
    status, plain = server.post("/tokenize", {"content": text})
    assert status == 200 and plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    _, pieces = server.post("/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == plain["tokens"]
    # a piece that is not whole UTF-8 comes as its bytes; together they are the text
    joined = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
        for p in pieces["tokens"]
    )
    assert joined == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])
    assert pieces["tokens"][0] == {"id": plain["tokens"][0], "piece": "Hello"}
    _, special = server.post("/tokenize", {"content": "<|im_start|>hi", "add_special": True})
    assert special["tokens"] == tokenizer("<|im_start|>hi", add_special_tokens=True)["input_ids"]
    assert special["tokens"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    _, literal = server.post("/tokenize", {"content": "<|im_start|>hi", "parse_special": False})
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in literal["tokens"]


def test_completion_reports_tokens_probabilities_timings_and_settings(server, greedy):
    assert greedy["tokens_predicted"] == 8 and greedy["stop_type"] == "limit"
    tokens = greedy["tokens"]
    assert len(tokens) == 8
    assert server.post("/detokenize", {"tokens": tokens})[1]["content"] == greedy["content"]
    probabilities = greedy["completion_probabilities"]
    assert [p["id"] for p in probabilities] == tokens
    for p in probabilities:
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]  # greedy: the likeliest was taken
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert bytes(p["bytes"]).decode() == p["token"] and p["logprob"] <= 0
    timings = greedy["timings"]
    assert timings["prompt_n"] == greedy["tokens_evaluated"] > 0
    assert timings["predicted_n"] == 8 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(8000 / timings["predicted_ms"])
    settings = greedy["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["n_ctx"]) == (8, 0.0, 1024)
    assert greedy["model"] == "smollm2" and greedy["prompt"] == PROMPT


def test_token_id_and_mixed_prompts_equal_the_text_prompt(server, greedy):
    ids = server.post("/tokenize", {"content": PROMPT})[1]["tokens"]
    assert complete(server, prompt=ids)["content"] == greedy["content"]
    head = server.post("/tokenize", {"content": "The history"})[1]["tokens"]
    assert complete(server, prompt=[*head, " of the Roman Empire"])["content"] == greedy["content"]


def test_several_prompts_and_completions_answer_a_list(server, greedy):
    other = complete(server, prompt="Once upon a time")
    several = complete(server, prompt=[PROMPT, "Once upon a time"])
    assert [r["index"] for r in several] == [0, 1]
    assert [r["content"] for r in several] == [greedy["content"], other["content"]]
    pair = complete(server, prompt=PROMPT, n_cmpl=2)
    assert [r["content"] for r in pair] == [greedy["content"]] * 2


def test_logit_bias_lists_ban_and_boost_tokens(server, greedy):
    first, runner_up = greedy["completion_probabilities"][0]["top_logprobs"][:2]
    banned = complete(server, prompt=PROMPT, n_predict=1, logit_bias=[[first["id"], False]])
    assert banned["content"] == runner_up["token"]
    boosted = complete(server, prompt=PROMPT, n_predict=1, logit_bias=[[runner_up["id"], 50]])
    assert boosted["content"] == runner_up["token"]
    by_text = complete(server, prompt=PROMPT, n_predict=1, logit_bias=[[first["token"], False]])
    assert by_text["content"] != first["token"]
    openai_form = complete(server, prompt=PROMPT, n_predict=1, logit_bias={str(first["id"]): -100})
    assert openai_form["content"] == runner_up["token"]


def test_a_stop_word_is_reported(server, greedy):
    word = greedy["completion_probabilities"][2]["token"]
    stopped = complete(server, prompt=PROMPT, stop=[word])
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert greedy["content"].startswith(stopped["content"] + word)


def test_streaming_events_add_up_to_the_answer(server, greedy):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True, "n_probs": 1}
    with httpx.stream(
        "POST", server.url + "/completion", json=body, headers=server.headers(), timeout=HANG_S
    ) as reply:
        events = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data:")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == greedy["content"]
    assert [t for e in events for t in e["tokens"]] == greedy["tokens"]
    ids = [p["id"] for e in events for p in e["completion_probabilities"]]
    assert ids == greedy["tokens"]
    assert events[-1]["timings"]["predicted_n"] == 8


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mirostat", 2),
        ("samplers", ["top_k", "temperature"]),
        ("typical_p", 0.5),
        ("dry_multiplier", 0.8),
        ("id_slot", 0),
        ("n_predict", 0),
        ("repeat_last_n", 64),
        ("n_probs", 99),
    ],
)
def test_unsupported_or_bad_fields_are_400_naming_them(server, field, value):
    body = {"prompt": PROMPT, "n_predict": 4, field: value}
    if field == "repeat_last_n":
        body["repeat_penalty"] = 1.1  # a penalty over a window kestrel cannot honour
    status, reply = server.post("/completion", body)
    assert status == 400, reply
    assert reply["error"]["param"] == field
    assert complete(server, prompt=PROMPT, n_predict=1)["content"]  # the server serves on
