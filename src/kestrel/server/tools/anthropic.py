"""Tool use on Anthropic's Messages API: `tools` (`name`, `description`, `input_schema`),
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `tool_use` blocks in the
assistant's turns and the answer (ids `toolu_...`, `input` an object), `tool_result` blocks in
user turns, and the stream's tool_use blocks: `content_block_start`, `content_block_delta`s with
`input_json_delta` (the input's JSON as it is generated), `content_block_stop`.

`any` and a named tool are `required` and a named choice on chat completions (a grammar forces
the calls); client tools only: a server tool (web_search, bash, text_editor, ...) is a 400 naming
its type.
"""

import json
import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from kestrel.errors import InvalidRequestError
from kestrel.server.bodies import StrictBody
from kestrel.server.protocol import FUNCTION_NAME
from kestrel.server.tools.parsers import ToolCall, ToolParser
from kestrel.server.tools.request import offer
from kestrel.server.tools.stream import CallDelta
from kestrel.server.tools.turns import Turns

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # `tool`: the tool's name


class ToolParam(StrictBody):
    type: str | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None  # accepted: nothing is cached

    @field_validator("type")
    @classmethod
    def _custom_only(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported_tool",
                "tool type '{kind}' is not supported: this server runs no server tools, only "
                "client tools (name, description, input_schema) that the client calls",
                {"kind": kind},
            )
        return kind


class ToolChoiceParam(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def function(self) -> str:
        """The chat completions choice: auto, required, none or the tool's name."""
        if (self.type == "tool") != (self.name is not None):
            raise InvalidRequestError(
                "tool_choice.name names the tool to call, with type tool (and only then)",
                param="tool_choice.name",
            )
        return self.name or CHOICES[self.type]


def tool_use(parser: ToolParser, tools: list[ToolParam] | None, choice: ToolChoiceParam | None):
    functions = [
        {"name": t.name, "parameters": t.input_schema}
        | ({"description": t.description} if t.description is not None else {})
        for t in tools or ()
    ]
    parallel = not (choice and choice.disable_parallel_tool_use)
    return offer(
        parser,
        functions,
        choice and choice.function(),
        parallel,
        lambda i, field: f"tools[{i}].{'input_schema' if field == 'parameters' else field}",
    )


# -- tool blocks in the conversation ----------------------------------------------------------


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ResultText(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[ResultText] | str = ""
    is_error: bool = False
    cache_control: dict | None = None

    def text(self) -> str:
        content = self.content
        text = content if isinstance(content, str) else "".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


TOOL_BLOCKS = (ToolUseBlock, ToolResultBlock)


def add_results(turns: Turns, role: str, blocks: list, source: str) -> None:
    """A user turn's tool_result blocks, each a tool message (before the turn's other blocks)."""
    for j, block in _tool_blocks(role, blocks, source):
        if isinstance(block, ToolResultBlock):
            param = f"{source}.content[{j}].tool_use_id"
            turns.result(block.tool_use_id, block.text(), source, param)


def add_calls(turns: Turns, role: str, blocks: list, source: str) -> None:
    """An assistant turn's tool_use blocks, its calls (after its text)."""
    for j, block in _tool_blocks(role, blocks, source):
        if isinstance(block, ToolUseBlock):
            param = f"{source}.content[{j}].id"
            turns.call(block.id, block.name, block.input, source, param)


def _tool_blocks(role: str, blocks: list, source: str):
    for j, block in enumerate(blocks):
        if not isinstance(block, TOOL_BLOCKS):
            continue
        belongs = "assistant" if isinstance(block, ToolUseBlock) else "user"
        if role != belongs:
            param = f"{source}.content[{j}]"
            raise InvalidRequestError(
                f"{param}: {block.type} blocks belong in {belongs} messages", param=param
            )
        yield j, block


# -- the answer's tool_use blocks -------------------------------------------------------------


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=lambda: f"toolu_{uuid.uuid4().hex[:24]}")
    name: str
    input: dict

    @classmethod
    def of(cls, call: ToolCall) -> "ToolUseContent":
        return cls(name=call.name, input=json.loads(call.arguments))


class ToolUseBlocks:
    """The stream's tool_use blocks, made from call pieces through `event(kind, **fields)`;
    `blocks` counts the message's content blocks so far (text ones too)."""

    def __init__(self, event, blocks: list):
        self.event, self.blocks = event, blocks
        self.open: dict[int, int] = {}  # call index -> its block index

    def events(self, piece: CallDelta) -> list[str]:
        if piece.name is not None:
            self.open[piece.index] = at = len(self.blocks)
            self.blocks.append("tool_use")
            block = {"type": "tool_use", "id": ToolUseContent(name=piece.name, input={}).id}
            block |= {"name": piece.name, "input": {}}
            return [self.event("content_block_start", index=at, content_block=block)]
        if piece.done:
            return [self.event("content_block_stop", index=self.open.pop(piece.index))]
        delta = {"type": "input_json_delta", "partial_json": piece.arguments}
        return [self.event("content_block_delta", index=self.open[piece.index], delta=delta)]

    def close(self) -> list[str]:
        """The blocks of calls cut short (max_tokens) end where they were cut."""
        return [self.event("content_block_stop", index=self.open.pop(i)) for i in list(self.open)]
