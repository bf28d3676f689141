"""The tool-call syntaxes of their own (Gemma 4, Qwen3-Coder and Qwen3.5, GLM-4.7) on a real
`kestrel serve`, through the real `openai` client, with the chat templates the families publish
(llama.cpp's copies) and, where the family thinks, a call after the thinking.

The tiny random Llama of tests/test_server_reasoning.py writes the thinking from a `logit_bias`
script; the call after it comes from a grammar (`guided_grammar`, the family's markers as their
tokens) with tool_choice `auto`, so the server reads it as it reads a free answer. Gemma 4 then
writes `<|tool_response>`, where its template puts the results: the answer must end there.
"""

import json
from dataclasses import dataclass

import pytest
from tests.server_fixtures import start_server
from tests.test_server_reasoning import (
    GEMMA4_TOOL_TOKENS,
    TEMPLATES,
    Family,
    Served,
    _checkpoint,
    _reasoning,
    _streamed,
)

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
ARGUMENTS = {"city": "Paris", "days": 3}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = ["Paris", " is", " sunny"]


@dataclass
class Case:
    family: Family
    parser: str  # the tool parser the server must choose from the template
    call: list[str]  # the answer's call: marker tokens and text, as the model writes it
    after: tuple[str, ...] = ()  # what the grammar writes after the call (never sent)


CASES = {
    "gemma4": Case(
        Family(
            TEMPLATES / "google-gemma-4-31B-it.jinja",
            ["<|channel>", "thought", "\n", *THOUGHT, "<channel|>"],
            special=("<|channel>", "<channel|>", *GEMMA4_TOOL_TOKENS),
            kwargs={"enable_thinking": True},
        ),
        "gemma4",
        ["<|tool_call>", "call:get_weather{city:", '<|"|>', "Paris", '<|"|>', ",days:3}"]
        + ["<tool_call|>"],
        after=("<|tool_response>", " It is warm."),
    ),
    "qwen3.5": Case(
        Family(
            TEMPLATES / "Qwen3.5-4B.jinja",
            [*THOUGHT, "</think>"],
            tokens=("<think>", "</think>", "<tool_call>", "</tool_call>"),
        ),
        "qwen3_coder",
        ["<tool_call>", "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"]
        + ["<parameter=days>\n3\n</parameter>\n</function>\n", "</tool_call>"],
    ),
    "qwen3-coder": Case(
        Family(
            TEMPLATES / "Qwen3-Coder.jinja",
            [],
            tokens=("<tool_call>", "</tool_call>"),
            reasoning="",
        ),
        "qwen3_coder",
        ["<tool_call>", "\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"]
        + ["<parameter=city>\nParis\n</parameter>\n</function>\n", "</tool_call>"],
    ),
    "glm-4.7": Case(
        Family(
            TEMPLATES / "GLM-4.7-Flash.jinja",
            [*THOUGHT, "</think>"],
            tokens=("<think>", "</think>"),
        ),
        "glm47",
        ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"]
        + ["<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"],
    ),
}


@dataclass
class Server(Served):
    case: Case | None = None

    def grammar(self, pieces: list[str]) -> str:
        """A Lark grammar of exactly `pieces`, marker tokens by their ids."""
        markers = {*self.family.tokens, *self.family.special}
        parts = [f"<[{self.token(p)}]>" if p in markers else json.dumps(p) for p in pieces]
        return "start: " + " ".join(parts)

    def call(self, **kwargs):
        """The thinking from the script, the call (and what follows it) from the grammar."""
        grammar = self.grammar([*self.case.call, *self.case.after])
        pieces = [*self.family.thinking, *self.case.after[:1]]  # Gemma 4's end: before EOS
        extra = {"guided_grammar": grammar}
        return self.chat(pieces, tools=[WEATHER], max_tokens=96, extra_body=extra, **kwargs)

    def chat(self, pieces, messages=QUESTION, extra_body=None, **kwargs):
        kwargs = {**self.script(pieces), **kwargs}
        template = self.family.kwargs
        extra = {**(extra_body or {}), **({"chat_template_kwargs": template} if template else {})}
        return self.client.chat.completions.create(
            model="thinking", messages=messages, extra_body=extra, **kwargs
        )


@pytest.fixture(scope="module", params=list(CASES))
def served(request, smollm2_tokenizer) -> Server:
    from transformers import AutoTokenizer

    case = CASES[request.param]
    folder = _checkpoint(f"tools-{request.param}", case.family, smollm2_tokenizer)
    server = start_server(["-m", folder, "-a", "thinking", "-c", "1024", "-np", "4"])
    assert f"tool calls: {case.parser}," in server.log()  # chosen from the template
    tokenizer = AutoTokenizer.from_pretrained(folder)
    yield Server(request.param, case.family, server, tokenizer, case)
    server.stop()


def _thought(served: Server) -> str | None:
    return served.family.reasoning or None


def test_a_call_after_the_thinking_is_read_from_the_answer(served):
    answer = served.call().choices[0]
    assert _reasoning(answer.message) == _thought(served)
    [call] = answer.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    assert answer.message.content is None  # nothing after the call (Gemma 4: it ended there)
    assert answer.finish_reason == "tool_calls"


def test_a_streamed_call_adds_up_to_the_whole_one(served):
    whole = served.call().choices[0].message
    chunks = list(served.call(stream=True))
    reasoning, content, calls, _ = _streamed(chunks)
    assert (reasoning or None, content) == (_thought(served), "")
    [call] = whole.tool_calls
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "tool_calls"


# values the random model cannot run on with: a string of the enum, a one-digit integer
BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}


def test_required_writes_the_family_syntax_with_typed_values(served):
    tool = {"type": "function", "function": {**WEATHER["function"], "parameters": BOUNDED}}
    kwargs = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    answer = served.chat(served.family.thinking, max_tokens=96, **kwargs).choices[0]
    assert _reasoning(answer.message) == _thought(served)
    [call] = answer.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    assert arguments["city"] in ("Paris", "Rome") and arguments["days"] in range(1, 10)
    assert answer.finish_reason == "tool_calls"


def test_the_call_and_its_result_go_back_through_the_template(served):
    """An earlier call (arguments a JSON object) and its result render in the family's
    template: the prompt is the template's, token for token."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
    ]
    answer = served.chat(["It"], messages=messages, tools=[WEATHER])
    rendered = [
        {**m, "tool_calls": [{**call, "function": {**call["function"], "arguments": ARGUMENTS}}]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    expected = served.tokenizer.apply_chat_template(
        rendered,
        tools=[WEATHER],
        add_generation_prompt=True,
        return_dict=False,
        **served.family.kwargs,
    )
    assert answer.usage.prompt_tokens == len(expected)
