"""Tool calls out of a stream of text deltas: content is passed on until the calls part of the
answer begins (text that may begin a marker is held back), then each call in pieces: its name once
the model wrote it, its arguments as they are written, and a last piece once the call is whole.

The deltas always add up to the whole answer's parse: the content streamed is a prefix of the
final content, and each call's streamed arguments a prefix of its final arguments (parsers keep a
JSON call's arguments as the model wrote them; `ToolParser.pending` reads the one being written,
and formats it cannot read, such as GLM's tags or Python calls, send their arguments whole).
`finish` sends the rest.
"""

from dataclasses import dataclass

from kestrel.server.tools.parsers import ToolCall, ToolParser


def visible_content(content: str) -> str | None:
    """The message content beside tool calls: None when only whitespace is left."""
    return content.strip() or None


@dataclass(frozen=True)
class CallDelta:
    """A piece of streamed call `index`: the first has its `name`, the next add `arguments`
    text, and the last is `done` (the call is whole; `arguments` then holds all of them)."""

    index: int
    arguments: str = ""
    name: str | None = None
    done: bool = False


class ToolStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.shown = ""  # content sent so far
        self.sent = 0  # calls sent whole so far
        self.streamed: list[str] = []  # the arguments sent of each call begun
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(content to send now, call pieces to send now)."""
        self.text += delta
        content = ""
        if not self.in_calls:
            begin = self.parser.start(self.text)
            self.in_calls = begin >= 0
            safe = begin if self.in_calls else len(self.text) - self.parser.held(self.text)
            content = self._show(self.text[:safe].strip())
            if not self.in_calls:
                return content, []
        calls = self.parser.parse(self.text, final=False)[1]
        pieces = self._whole(calls)
        pending = self.parser.pending(self.text)
        if pending is not None and pending[0] == len(calls) == self.sent:
            pieces += self._piece(self.sent, pending[1].name, pending[1].arguments)
        return content, pieces

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The rest, once the answer ended."""
        content, calls = self.parser.parse(self.text, final=True)
        return self._show(content.strip()), self._whole(calls)

    @property
    def begun(self) -> int:
        """How many calls have sent a piece."""
        return len(self.streamed)

    def _show(self, content: str) -> str:
        # whitespace at either end is held: the whole answer's content is stripped
        if not content.startswith(self.shown):
            return ""
        new, self.shown = content[len(self.shown) :], content
        return new

    def _whole(self, calls: list[ToolCall]) -> list[CallDelta]:
        pieces = []
        for index in range(self.sent, len(calls)):
            pieces += self._piece(index, calls[index].name, calls[index].arguments)
            pieces.append(CallDelta(index, calls[index].arguments, done=True))
        self.sent = max(self.sent, len(calls))
        return pieces

    def _piece(self, index: int, name: str, arguments: str) -> list[CallDelta]:
        pieces = []
        if index == len(self.streamed):
            self.streamed.append("")
            pieces.append(CallDelta(index, name=name))
        sent = self.streamed[index]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            self.streamed[index] = arguments
            pieces.append(CallDelta(index, arguments[len(sent) :]))
        return pieces
