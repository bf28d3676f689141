"""Tool calls out of a stream of text deltas: content is passed on until the calls part of the
answer begins (text that may begin a marker is held back), then each call once it is whole.

The deltas always add up to the whole answer's parse: the content streamed is a prefix of the
final content and the calls streamed a prefix of the final calls (`ToolParser.parse` with `final`
False parses only calls that no later text can change), and `finish` sends the rest.
"""

from kestrel.server.tools.parsers import ToolCall, ToolParser


def visible_content(content: str) -> str | None:
    """The message content beside tool calls: None when only whitespace is left."""
    return content.strip() or None


class ToolStream:
    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.shown = ""  # content sent so far
        self.sent = 0  # calls sent so far
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        self.text += delta
        if not self.in_calls:
            begin = self.parser.start(self.text)
            self.in_calls = begin >= 0
            safe = begin if self.in_calls else len(self.text) - self.parser.held(self.text)
            content = self._show(self.text[:safe].strip())
            if not self.in_calls:
                return content, []
            return content, self._new(self.parser.parse(self.text, final=False)[1])
        return "", self._new(self.parser.parse(self.text, final=False)[1])

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest, once the answer ended."""
        content, calls = self.parser.parse(self.text, final=True)
        return self._show(content.strip()), self._new(calls)

    def _show(self, content: str) -> str:
        # whitespace at either end is held: the whole answer's content is stripped
        if not content.startswith(self.shown):
            return ""
        new, self.shown = content[len(self.shown) :], content
        return new

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.sent :]
        self.sent = max(self.sent, len(calls))
        return new
