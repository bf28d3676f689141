"""Tools and tool turns into the chat template.

A template that knows tools (it mentions `tools`, as Qwen's, Llama 3.1's, Mistral's do) gets them
as transformers passes them: `tools=` to `apply_chat_template`, assistant `tool_calls` with dict
arguments, `tool` messages with `tool_call_id`. A template that does not (SmolLM2's) would drop
them silently, so kestrel writes them in: a system prompt describing the tools and the parser's
call syntax (Hermes' `<tool_call>{"name", "arguments"}</tool_call>` by default, Qwen 2.5's
wording), earlier calls as the text the model would have written, and tool results as a user turn
of `<tool_response>` blocks (templates that only know user and assistant accept it).
"""

import json
import re

from kestrel.server.tools.parsers import ToolCall, template_text
from kestrel.server.tools.request import ToolUse

_MENTIONS_TOOLS = re.compile(r"\btools\b")

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, write a JSON object with the function name and arguments:
{syntax}"""

CHOICE_PROMPTS = {
    "auto": "",
    "required": "\n\nCall at least one function now.",
}
NAMED_PROMPT = "\n\nCall the function {name} now."


def knows_tools(tokenizer) -> bool:
    return bool(_MENTIONS_TOOLS.search(template_text(tokenizer)))


def template_messages(
    tokenizer, messages: list[dict], tools: ToolUse, images: bool = False
) -> tuple[list[dict], dict]:
    """(the messages, keyword arguments of apply_chat_template). With images the prompt is the
    model's processor's, which takes no `tools`: they are written in as for other templates."""
    if knows_tools(tokenizer) and not images:
        return messages, ({"tools": tools.tools} if tools.offered else {})
    return _written_in(messages, tools), {}


def _written_in(messages: list[dict], tools: ToolUse) -> list[dict]:
    out: list[dict] = []
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # one user turn for consecutive results
                out[-1] = out[-1] | {"content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            out.append(_calls_as_text(message, tools))
        else:
            out.append(message)
    return _with_tools_prompt(out, tools) if tools.offered else out


def _calls_as_text(message: dict, tools: ToolUse) -> dict:
    calls = [
        ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    text = "\n".join(filter(None, [message["content"], tools.parser.render(calls)]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _with_tools_prompt(messages: list[dict], tools: ToolUse) -> list[dict]:
    described = "\n".join(json.dumps(t) for t in tools.tools)
    prompt = TOOLS_PROMPT.format(tools=described, syntax=tools.parser.syntax)
    prompt += CHOICE_PROMPTS.get(tools.choice, NAMED_PROMPT.format(name=tools.choice))
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        first = messages[0] | {"content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
