"""Tools into the chat template, on SmolLM2's real tokenizer: a template that knows tools gets them
as transformers passes them (`tools=`, dict arguments, `tool_call_id`); one that does not (SmolLM2's
own) gets a system prompt describing them and the calls and results written as text."""

import json

import pytest

from kestrel.server.protocol import ChatCompletionRequest
from kestrel.server.tools.parsers import PARSERS
from kestrel.server.tools.prompt import template_messages
from kestrel.server.tools.request import check_tool_messages, tool_use

# a minimal template in the style of Qwen 2.5's: tools in the system turn, calls as JSON
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}"
    "{% if m['role'] == 'tool' %} (for {{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
MESSAGES = [
    {"role": "user", "content": "Time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
]


def _prompt(tokenizer, choice="auto") -> str:
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [TOOL], "tool_choice": choice}
    )
    check_tool_messages(body.messages)
    messages = [m.as_template_dict(f"messages[{i}].") for i, m in enumerate(body.messages)]
    messages, kwargs = template_messages(tokenizer, messages, tool_use(body, PARSERS["hermes"]()))
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )


@pytest.fixture
def tools_tokenizer(smollm2_tokenizer):
    original = smollm2_tokenizer.chat_template
    smollm2_tokenizer.chat_template = TOOLS_TEMPLATE
    yield smollm2_tokenizer
    smollm2_tokenizer.chat_template = original


def test_a_template_that_knows_tools_gets_them_natively(tools_tokenizer):
    assert _prompt(tools_tokenizer) == (  # transformers' jinja trims a newline after a tag
        "TOOLS:get_time;"
        "user: Time in Paris?"
        'assistant: CALL call_1 get_time {"zone": "CET"}'
        "tool: 12:00 (for call_1)"
        "tool: noon (for call_1)"
        "assistant:"
    )


def test_tool_choice_none_offers_no_tools_to_the_template(tools_tokenizer):
    assert not _prompt(tools_tokenizer, "none").startswith("TOOLS:")


def test_a_template_without_tools_gets_them_written_in(smollm2_tokenizer):
    prompt = _prompt(smollm2_tokenizer, "required")
    system, user, call, results, end = prompt.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOL) in system
    assert PARSERS["hermes"].syntax in system and "Call at least one function" in system
    assert user == "<|im_start|>user\nTime in Paris?"
    assert call == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
        "\n</tool_call>"
    )
    assert results == (
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n"
        "<tool_response>\nnoon\n</tool_response>"
    )
    assert end == "<|im_start|>assistant\n"
