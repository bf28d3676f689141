"""A chat answer's tool calls in OpenAI's shapes: `message.tool_calls` (ids `call_...`) and
`finish_reason` "tool_calls"; streamed, each call as two `delta.tool_calls` pieces, the first with
its index, id and name, the second with its arguments (clients join pieces by index)."""

import uuid

from kestrel.server.protocol import (
    AssistantMessage,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from kestrel.server.tools.parsers import ToolCall
from kestrel.server.tools.request import ToolUse
from kestrel.server.tools.stream import ToolStream, visible_content


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, calls: int) -> str | None:
    """An answer that ended by itself after calls finished to call them (cut: still `length`)."""
    return "tool_calls" if calls and reason == "stop" else reason


def assistant_message(text: str, tools: ToolUse) -> tuple[AssistantMessage, int]:
    """(the message, how many calls it makes). Without tools offered the text is the content."""
    if not tools.offered:
        return AssistantMessage(content=text), 0
    content, calls = tools.parser.parse(text)
    if tools.forced:  # the grammar allows only calls: anything else is one cut by max_tokens
        content = ""
    out = [
        ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=visible_content(content), tool_calls=out or None), len(out)


def call_deltas(calls: list[ToolCall], first_index: int) -> list[DeltaToolCall]:
    deltas = []
    for index, call in enumerate(calls, first_index):
        named = DeltaFunction(name=call.name, arguments="")
        deltas.append(DeltaToolCall(index=index, id=new_call_id(), type="function", function=named))
        deltas.append(DeltaToolCall(index=index, function=DeltaFunction(arguments=call.arguments)))
    return deltas


class StreamedChoice:
    """One streamed choice's text split into content and call deltas."""

    def __init__(self, tools: ToolUse):
        self.stream = ToolStream(tools.parser) if tools.offered else None
        self.forced = tools.forced

    def feed(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.stream is None:
            return text, []
        sent = self.stream.sent
        content, calls = self.stream.feed(text)
        if finished:
            rest, more = self.stream.finish()
            content, calls = content + rest, calls + more
        return ("" if self.forced else content), call_deltas(calls, sent)

    @property
    def calls(self) -> int:
        return self.stream.sent if self.stream else 0
