"""A chat answer's tool calls in OpenAI's shapes: `message.tool_calls` (ids `call_...`) and
`finish_reason` "tool_calls"; streamed, each call as `delta.tool_calls` pieces, the first with its
index, id and name, the next with its arguments as they are generated (clients join pieces by
index)."""

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
from kestrel.server.tools.stream import CallDelta, ToolStream, visible_content


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, calls: int) -> str | None:
    """An answer that ended by itself after calls finished to call them (cut: still `length`)."""
    return "tool_calls" if calls and reason == "stop" else reason


def split_answer(text: str, tools: ToolUse) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer. Without tools offered the text is the content."""
    if not tools.offered:
        return text, []
    content, calls = tools.parser.parse(text)
    if tools.forced:  # the grammar allows only calls: anything else is one cut by max_tokens
        content = ""
    return visible_content(content), calls


def assistant_message(text: str, tools: ToolUse) -> tuple[AssistantMessage, int]:
    """(the message, how many calls it makes)."""
    content, calls = split_answer(text, tools)
    out = [
        ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return AssistantMessage(content=content, tool_calls=out or None), len(out)


def call_deltas(pieces: list[CallDelta], ids: dict[int, str]) -> list[DeltaToolCall]:
    """Chat's `delta.tool_calls` of call pieces: the first of a call has its index, id (kept in
    `ids`) and name, the next add arguments; a call's last piece adds nothing."""
    deltas = []
    for piece in pieces:
        if piece.name is not None:
            ids[piece.index] = new_call_id()
            named = DeltaFunction(name=piece.name, arguments="")
            deltas.append(
                DeltaToolCall(
                    index=piece.index, id=ids[piece.index], type="function", function=named
                )
            )
        elif piece.arguments and not piece.done:
            more = DeltaFunction(arguments=piece.arguments)
            deltas.append(DeltaToolCall(index=piece.index, function=more))
    return deltas


class StreamedChoice:
    """One streamed choice's text split into content and call deltas."""

    def __init__(self, tools: ToolUse):
        self.stream = ToolStream(tools.parser) if tools.offered else None
        self.forced = tools.forced
        self.ids: dict[int, str] = {}

    def feed(self, text: str, finished: bool) -> tuple[str, list[CallDelta]]:
        """(content, call pieces) of the next text."""
        if self.stream is None:
            return text, []
        content, pieces = self.stream.feed(text)
        if finished:
            rest, more = self.stream.finish()
            content, pieces = content + rest, pieces + more
        return ("" if self.forced else content), pieces

    def chat_deltas(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        content, pieces = self.feed(text, finished)
        return content, call_deltas(pieces, self.ids)

    @property
    def calls(self) -> int:
        return self.stream.begun if self.stream else 0
