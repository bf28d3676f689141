"""Tool calls on OpenAI's Responses API: its flat function `tools`, `tool_choice`, the
`function_call` / `function_call_output` input items, and `function_call` output items, streamed
as `response.output_item.added`, `response.function_call_arguments.delta`...,
`response.function_call_arguments.done` and `response.output_item.done`.

Only function tools exist here: a hosted tool (web_search, file_search, code_interpreter, ...) is a
400 naming its type, as the server has none of them to run.
"""

import json
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from kestrel.server.bodies import StrictBody
from kestrel.server.protocol import FUNCTION_NAME
from kestrel.server.tools.parsers import ToolCall, ToolParser
from kestrel.server.tools.request import ToolUse, offer
from kestrel.server.tools.stream import CallDelta
from kestrel.server.tools.turns import Turns, arguments_object, template_call

Status = Literal["in_progress", "completed", "incomplete"]


class FunctionToolParam(StrictBody):
    type: str
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; omitted: no arguments
    strict: bool | None = None  # kestrel enforces the schema whenever it forces a call

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            raise PydanticCustomError(
                "unsupported_tool",
                "tool type '{kind}' is not supported: this server runs no hosted tools, only "
                "function tools (type function) that the client calls",
                {"kind": kind},
            )
        return kind


class FunctionChoice(StrictBody):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice


def tool_use(
    parser: ToolParser,
    tools: list[FunctionToolParam] | None,
    choice: ToolChoice | None,
    parallel: bool,
) -> ToolUse:
    functions = [t.model_dump(exclude={"type", "strict"}, exclude_none=True) for t in tools or ()]
    name = choice.name if isinstance(choice, FunctionChoice) else choice
    return offer(parser, functions, name, parallel, lambda i, field: f"tools[{i}].{field}")


# -- input items ------------------------------------------------------------------------------


class InputText(StrictBody):
    type: Literal["input_text"]
    text: str


class FunctionCallItem(StrictBody):
    """An earlier answer's call, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # the JSON text of an object
    id: str | None = None
    status: Status | None = None

    def add_to(self, turns: Turns, source: str) -> None:
        arguments = arguments_object(self.arguments, f"{source}.arguments")
        turns.call(self.call_id, self.name, arguments, source, f"{source}.call_id")


class FunctionCallOutputItem(StrictBody):
    """The result of a call (`call_id`: an earlier function_call's)."""

    type: Literal["function_call_output"]
    call_id: str
    output: list[InputText] | str
    id: str | None = None
    status: Status | None = None

    def add_to(self, turns: Turns, source: str) -> None:
        output = self.output
        text = output if isinstance(output, str) else "".join(part.text for part in output)
        turns.result(self.call_id, text, source, f"{source}.call_id")


# -- output items -----------------------------------------------------------------------------


class FunctionCallOutput(BaseModel):
    """A `function_call` output item."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status = "completed"

    @classmethod
    def of(cls, call: ToolCall, status: Status = "completed") -> "FunctionCallOutput":
        return cls(
            id=f"fc_{uuid.uuid4().hex}",
            call_id=f"call_{uuid.uuid4().hex[:24]}",
            name=call.name,
            arguments=call.arguments,
            status=status,
        )

    def as_template_call(self) -> dict:
        return template_call(self.call_id, self.name, json.loads(self.arguments))


class CallItems:
    """The function_call items of a stream, made from call pieces: each piece becomes its
    events, through `event(kind, **fields)` (the stream's numbered SSE event maker)."""

    def __init__(self, event, output: list):
        self.event, self.output = event, output  # the response's output items, in order
        self.open: dict[int, int] = {}  # call index -> its output index

    def events(self, piece: CallDelta) -> list[str]:
        if piece.name is not None:
            self.open[piece.index] = at = len(self.output)
            item = FunctionCallOutput.of(ToolCall(piece.name, ""), "in_progress")
            self.output.append(item)
            return [self.event("response.output_item.added", output_index=at, item=_dump(item))]
        at = self.open[piece.index]
        item = self.output[at]
        if piece.done:
            return self._close(piece.index, "completed", piece.arguments)
        item.arguments += piece.arguments
        delta = {"item_id": item.id, "delta": piece.arguments}
        return [self.event("response.function_call_arguments.delta", output_index=at, **delta)]

    def close(self) -> list[str]:
        """Events that end the calls cut short (max_output_tokens): their items incomplete."""
        return [e for index in list(self.open) for e in self._close(index, "incomplete")]

    def _close(self, index: int, status: Status, arguments: str | None = None) -> list[str]:
        at = self.open.pop(index)
        item = self.output[at]
        item.arguments = item.arguments if arguments is None else arguments
        item.status = status
        done = {"item_id": item.id, "name": item.name, "arguments": item.arguments}
        return [
            self.event("response.function_call_arguments.done", output_index=at, **done),
            self.event("response.output_item.done", output_index=at, item=_dump(item)),
        ]


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json")
