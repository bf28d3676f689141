"""What a chat request asks of tools: the tools offered, `tool_choice`, `parallel_tool_calls`;
checked (a 400 naming the field), and the grammar that enforces `required` and a named choice.

`auto` leaves generation free and parses calls out of the answer; `none` offers no tools to the
template and parses nothing; `required` and a named function force an answer made only of calls
(one, with `parallel_tool_calls` false) whose arguments match the function's parameters schema,
through the structured-output machinery (kestrel.structured, a Lark grammar for llguidance).
"""

import json
from dataclasses import dataclass, field

from kestrel import structured
from kestrel.errors import InvalidRequestError
from kestrel.server.protocol import ChatMessage, FunctionTool, NamedToolChoice
from kestrel.server.tools.parsers import ToolParser
from kestrel.structured import StructuredOutput

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolUse:
    parser: ToolParser
    tools: list[dict] = field(default_factory=list)  # OpenAI function tools, as templates take
    choice: str = "auto"  # auto, none, required, or the name of the function to call
    parallel: bool = True

    @property
    def offered(self) -> bool:
        """The template renders the tools and the answer is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.offered and self.choice != "auto"

    def constraints(self) -> list[StructuredOutput]:
        """The grammar of an answer made of calls, when the choice forces one."""
        if not self.forced:
            return []
        grammar = self.parser.grammar(self._call_schema(), self.parallel)
        return [StructuredOutput("lark", grammar, param="tool_choice")]

    def _call_schema(self) -> dict:
        # one alternative per callable function: its name, then its arguments (in that order:
        # llguidance keeps the properties' order, and parsers read the name first)
        key = self.parser.arguments_key
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, key: _parameters(f)},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
                for f in (t["function"] for t in self.tools)
                if self.choice in ("required", f["name"])
            ]
        }


def _parameters(function: dict) -> dict:
    return function.get("parameters") or NO_ARGUMENTS


def tool_use(body, parser: ToolParser) -> ToolUse:
    """The ToolUse of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`, messages);
    InvalidRequestError naming the field that is wrong."""
    tools = body.tools or []
    check_tools(tools)
    choice = _choice(body.tool_choice, tools)
    return ToolUse(
        parser,
        [t.model_dump(exclude_none=True) for t in tools],
        choice,
        body.parallel_tool_calls,
    )


def check_tools(tools: list[FunctionTool]) -> None:
    """Unique names, and parameters that are a JSON schema llguidance compiles."""
    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise InvalidRequestError(
                f"tools[{i}].function.name: {name!r} is offered twice",
                param=f"tools[{i}].function.name",
            )
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None:
            structured.json_schema(parameters, f"tools[{i}].function.parameters").check()


def _choice(choice: str | NamedToolChoice | None, tools: list[FunctionTool]) -> str:
    if choice is None:
        return "auto"  # OpenAI's default with tools (and nothing to choose without)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
    if name in ("auto", "none"):
        return name
    if not tools:
        raise InvalidRequestError(
            f"tool_choice {json.dumps(name)} needs tools to call", param="tool_choice"
        )
    if name != "required" and name not in {t.function.name for t in tools}:
        offered = ", ".join(t.function.name for t in tools)
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools ({offered})",
            param="tool_choice",
        )
    return name


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Every `tool` message answers an earlier assistant call, by `tool_call_id`."""
    ids: set[str] = set()
    for i, message in enumerate(messages):
        ids.update(call.id for call in message.tool_calls or ())
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}].tool_calls: only assistant messages make calls",
                param=f"messages[{i}].tool_calls",
            )
        if message.role != "tool":
            continue
        param = f"messages[{i}].tool_call_id"
        if message.tool_call_id is None:
            raise InvalidRequestError(f"{param} is required in a tool message", param=param)
        if message.tool_call_id not in ids:
            raise InvalidRequestError(
                f"{param}: {message.tool_call_id!r} answers no earlier assistant tool call",
                param=param,
            )
