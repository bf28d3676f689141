"""Earlier tool calls and their results into chat messages, for the routes whose conversations
carry them in their own shapes (Responses' `function_call` / `function_call_output` items,
Anthropic's `tool_use` / `tool_result` blocks). The messages come out as chat completions'
`as_template_dict` makes them (kestrel.server.tools.prompt renders them): an assistant message
with `tool_calls` (arguments a dict) and a `tool` message per result. Each result must answer an
earlier call by its id, else a 400 naming the client's field.
"""

import json

from kestrel.errors import InvalidRequestError


def arguments_object(text: str, param: str) -> dict:
    """A call's arguments: the JSON text of an object, else a 400 naming `param`."""
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{param} must be the JSON text of an object", param=param)
    return arguments


def template_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class Turns:
    """Chat messages built in order, with the client's name of each (`sources`, for
    kestrel.server.prompts.ParamNames); calls and results checked as they come."""

    def __init__(self, messages: list[dict] = (), sources: list[str] = ()):
        self.messages, self.sources = [], []
        self.call_ids: set[str] = set()
        for message, source in zip(messages, sources, strict=True):
            self.add(message, source)

    def add(self, message: dict, source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)
        self.call_ids.update(c["id"] for c in message.get("tool_calls", ()))

    def call(self, call_id: str, name: str, arguments: dict, source: str, param: str) -> None:
        """An earlier call; consecutive calls (and a call right after the assistant's text)
        make one assistant message. `param` names the id in errors."""
        if call_id in self.call_ids:
            raise InvalidRequestError(f"{param}: {call_id!r} names two calls", param=param)
        self.call_ids.add(call_id)
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.add({"role": "assistant", "content": ""}, source)
        last = self.messages[-1]  # a copy: it may be a kept response's message
        calls = [*last.get("tool_calls", ()), template_call(call_id, name, arguments)]
        self.messages[-1] = last | {"tool_calls": calls}

    def result(self, call_id: str, content: str, source: str, param: str) -> None:
        """A call's result; `param` names its call id in errors."""
        if call_id not in self.call_ids:
            raise InvalidRequestError(
                f"{param}: {call_id!r} answers no earlier tool call", param=param
            )
        self.add({"role": "tool", "tool_call_id": call_id, "content": content}, source)
