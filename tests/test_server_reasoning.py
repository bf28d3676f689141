"""Reasoning parsers on a real `kestrel serve`, through the real `openai` client, with the chat
templates the thinking families publish (llama.cpp's copies in `models/templates`; EXAONE 4.0's in
tests/data).

Each family's server runs a tiny random Llama whose logits are near zero, saved with SmolLM2's
tokenizer, that family's template and the marker tokens its vocabulary has (Qwen3 and GLM: `<think>`
and `</think>`; Gemma 4: the special `<|channel>` and `<channel|>`). A request drives it with a
`logit_bias` script: the answer's tokens, biased in falling steps, with presence and frequency
penalties that push each token below the next once it is written, so that greedy decoding writes
exactly the script. Where the vocabulary has no marker tokens (EXAONE, DeepSeek-R1, Nemotron here)
the end marker comes in pieces (`</`, `think`, `>`), split across tokens.
"""

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from tests.llama_cpp_tools import LLAMA_CPP
from tests.server_fixtures import SESSION_DIR, start_server

pytestmark = pytest.mark.slow

TEMPLATES = LLAMA_CPP / "models" / "templates"
DATA = Path(__file__).parent / "data"
EOS = "<|im_end|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@dataclass
class Family:
    template: Path
    thinking: list[str]  # the answer's tokens, its block included, up to the end marker
    tokens: tuple[str, ...] = ()  # marker tokens the real vocabulary has (added, not special)
    special: tuple[str, ...] = ()  # ... as special tokens
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs that turn thinking on
    reasoning: str = "Paris is sunny"


SPLIT_END = ["</", "think", ">"]
# Gemma 4's tool-call marks, special tokens of its vocabulary
GEMMA4_TOOL_TOKENS = (
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
    "<|tool_response>",
)  # `</think>` where the vocabulary has no token for it
FAMILIES = {
    "qwen3": Family(
        TEMPLATES / "Qwen-Qwen3-0.6B.jinja",
        ["<think>", "\n", "Paris", " is", " sunny", "</think>"],
        tokens=("<think>", "</think>"),
    ),
    "glm45": Family(
        TEMPLATES / "GLM-4.7-Flash.jinja",
        ["Paris", " is", " sunny", "</think>"],
        tokens=("<think>", "</think>"),
    ),
    "gemma4": Family(
        TEMPLATES / "google-gemma-4-31B-it.jinja",
        ["<|channel>", "thought", "\n", "Paris", " is", " sunny", "<channel|>"],
        special=("<|channel>", "<channel|>", *GEMMA4_TOOL_TOKENS),
        kwargs={"enable_thinking": True},
    ),
    "exaone4": Family(
        DATA / "exaone4.jinja",
        ["Paris", " is", " sunny", "\n", *SPLIT_END],
        kwargs={"enable_thinking": True},
    ),
    "deepseek_r1": Family(
        TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        ["Paris", " is", " sunny", *SPLIT_END],
        kwargs={"enable_thinking": True},  # llama.cpp's copy closes the block without it
    ),
    "nemotron_v3": Family(
        TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
        ["Paris", " is", " sunny", "\n", *SPLIT_END],
    ),
}
ANSWER = ["\n\n", "It", "'s", " warm"]


def _checkpoint(name: str, family: Family, smollm2_tokenizer) -> str:
    """A 1-layer random Llama with near-zero logits (the script decides every token)."""
    import torch
    import transformers

    tokenizer = copy.deepcopy(smollm2_tokenizer)  # the session's: left as it was
    tokenizer.chat_template = family.template.read_text()
    tokenizer.add_tokens(list(family.tokens))
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.special)})
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=1e-4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = Path(SESSION_DIR) / f"thinking-{name}"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@dataclass
class Served:
    name: str
    family: Family
    server: object
    tokenizer: object

    @property
    def client(self):
        return self.server.client()

    def script(self, pieces: list[str]) -> dict:
        """Sampling arguments under which greedy decoding writes exactly `pieces`, then EOS."""
        ids = [self.token(p) for p in [*pieces, EOS]]
        assert len(set(ids)) == len(ids), pieces  # a penalty keeps a token from coming back
        bias = {str(t): 100 - 0.05 * i for i, t in enumerate(ids)}
        return {
            "logit_bias": bias,
            "presence_penalty": 2.0,
            "frequency_penalty": 2.0,
            "temperature": 0,
            "max_tokens": len(ids) + 8,
        }

    def token(self, piece: str) -> int:
        [token] = self.tokenizer.encode(piece, add_special_tokens=False)
        return token

    def chat(self, pieces: list[str], messages=QUESTION, **kwargs):
        kwargs = {**self.script(pieces), **kwargs}
        template = {**self.family.kwargs, **kwargs.pop("chat_template_kwargs", {})}
        extra = {"chat_template_kwargs": template} if template else {}
        return self.client.chat.completions.create(
            model="thinking", messages=messages, extra_body=extra, **kwargs
        )


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, smollm2_tokenizer) -> Served:
    from transformers import AutoTokenizer

    family = FAMILIES[request.param]
    folder = _checkpoint(request.param, family, smollm2_tokenizer)
    server = start_server(["-m", folder, "-a", "thinking", "-c", "1024", "-np", "4"])
    assert f"reasoning: {request.param}" in server.log()  # chosen from the template
    yield Served(request.param, family, server, AutoTokenizer.from_pretrained(folder))
    server.stop()


def _streamed(chunks) -> tuple[str, str, list, object]:
    reasoning, content, calls, usage = "", "", {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            extra = delta.model_extra or {}
            piece = extra.get("reasoning_content") or ""
            assert not (piece and delta.content), "a delta is reasoning or content, not both"
            reasoning += piece
            content += delta.content or ""
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return reasoning, content, list(calls.values()), usage


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_the_thinking_is_reasoning_content_and_the_rest_is_content(served):
    answer = served.chat([*served.family.thinking, *ANSWER])
    message = answer.choices[0].message
    assert _reasoning(message) == served.family.reasoning
    assert message.content == "It's warm"
    # the block's tokens, up to and including the end marker's last
    assert answer.usage.completion_tokens_details.reasoning_tokens == len(served.family.thinking)
    assert answer.usage.completion_tokens == len(served.family.thinking) + len(ANSWER) + 1


def test_streamed_deltas_add_up_to_the_whole_answer(served):
    pieces = [*served.family.thinking, *ANSWER]
    whole = served.chat(pieces).choices[0].message
    chunks = served.chat(pieces, stream=True, stream_options={"include_usage": True})
    reasoning, content, _, usage = _streamed(chunks)
    assert (reasoning, content) == (_reasoning(whole), whole.content)
    assert usage.completion_tokens_details.reasoning_tokens == len(served.family.thinking)


def test_an_answer_cut_inside_the_thinking_is_all_reasoning(served):
    thinking = served.family.thinking
    cut = len(thinking[: thinking.index(" sunny") + 1])
    answer = served.chat(thinking, max_tokens=cut)
    assert answer.choices[0].finish_reason == "length"
    assert _reasoning(answer.choices[0].message) == served.family.reasoning
    assert answer.choices[0].message.content in (None, "")


def test_a_tool_call_after_the_thinking_parses(served):
    kwargs = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    kwargs["max_tokens"] = 64  # the grammar writes the call after the script's thinking
    answer = served.chat(served.family.thinking, **kwargs).choices[0]
    assert _reasoning(answer.message) == served.family.reasoning
    [call] = answer.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert answer.finish_reason == "tool_calls"
    reasoning, _, calls, _ = _streamed(served.chat(served.family.thinking, stream=True, **kwargs))
    assert reasoning == served.family.reasoning
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_response_format_applies_to_the_answer_after_the_thinking(served):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    answer = served.chat(served.family.thinking, response_format=response_format, max_tokens=64)
    message = answer.choices[0].message
    assert _reasoning(message) == served.family.reasoning
    assert json.loads(message.content) == {"city": "Paris"}


def test_a_template_argument_it_does_not_read_is_a_400_naming_it(served):
    with pytest.raises(openai.BadRequestError) as error:
        served.chat(ANSWER, chat_template_kwargs={"no_such_switch": True})
    assert error.value.body["param"] == "chat_template_kwargs.no_such_switch"
    with pytest.raises(openai.BadRequestError) as error:
        served.chat(ANSWER, reasoning_effort="high")
    assert error.value.body["param"] == "reasoning_effort"
    assert served.chat(ANSWER).choices[0].finish_reason == "stop"  # and it still serves


# the other APIs take no logit_bias: where the template opens the block (GLM-4.7, Nemotron), the
# tiny model's own greedy tokens are all thinking, and each API must split them as chat does
OPENS_THE_BLOCK = ("glm45", "nemotron_v3")


def _free_chat(served: Served, tokens: int) -> str:
    answer = served.client.chat.completions.create(
        model="thinking", messages=QUESTION, temperature=0, max_tokens=tokens
    )
    assert answer.choices[0].message.content in (None, "")
    return _reasoning(answer.choices[0].message)


def test_responses_answer_the_thinking_as_a_reasoning_item(served):
    if served.name not in OPENS_THE_BLOCK:
        pytest.skip("driven by logit_bias, which the Responses API does not take")
    expected = _free_chat(served, 6)
    body = {"model": "thinking", "input": "Weather in Paris?", "max_output_tokens": 6}
    status, response = served.server.post("/v1/responses", {**body, "temperature": 0})
    assert status == 200, response
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": expected}]
    assert message["type"] == "message" and message["content"][0]["text"] == ""
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    stream = served.client.responses.create(**body, temperature=0, stream=True)
    deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == expected


def test_messages_answer_the_thinking_as_a_thinking_block(served):
    if served.name not in OPENS_THE_BLOCK:
        pytest.skip("driven by logit_bias, which the Messages API does not take")
    expected = _free_chat(served, 6)
    body = {"model": "thinking", "max_tokens": 6, "temperature": 0, "messages": QUESTION}
    status, message = served.server.post("/v1/messages", body)
    assert status == 200, message
    assert message["content"][0] == {"type": "thinking", "thinking": expected, "signature": ""}
    assert message["content"][1] == {"type": "text", "text": ""}
    # thinking off: the template closes the block, and the answer is all text
    status, message = served.server.post("/v1/messages", {**body, "thinking": {"type": "disabled"}})
    assert status == 200, message
    assert [block["type"] for block in message["content"]] == ["text"]
