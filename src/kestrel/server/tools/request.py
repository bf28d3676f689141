"""What a chat request asks of tools: the tools offered, `tool_choice`, `parallel_tool_calls`;
checked (a 400 naming the field), and the grammar that enforces `required` and a named choice.

`auto` leaves generation free and parses calls out of the answer; `none` offers no tools to the
template and parses nothing; `required` and a named function force an answer made only of calls
(one, with `parallel_tool_calls` false) whose arguments match the function's parameters schema,
through the structured-output machinery (kestrel.structured, a Lark grammar for llguidance).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from kestrel import structured
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.protocol import ChatMessage, NamedToolChoice
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

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` for an answer that may call: markers that are special tokens stay in the
        text (the parser reads them)."""
        if self.offered and self.parser.special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

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


# tool i's field -> the client's name for it (`tools[1].function.parameters` on chat)
ParamOf = Callable[[int, str], str]


def chat_param(i: int, name: str) -> str:
    return f"tools[{i}].function.{name}"


def tool_use(body, parser: ToolParser) -> ToolUse:
    """The ToolUse of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`);
    InvalidRequestError naming the field that is wrong."""
    choice = body.tool_choice
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools or ()]
    return offer(parser, functions, name, body.parallel_tool_calls)


def offer(
    parser: ToolParser,
    functions: list[dict],
    choice: str | None,
    parallel: bool = True,
    param: ParamOf = chat_param,
) -> ToolUse:
    """The ToolUse of functions (OpenAI's `{"name", "description", "parameters"}`, from any
    route), a choice (None, auto, none, required or a function's name) and whether calls may
    be parallel; `param` names a tool's fields in errors."""
    check_functions(functions, param)
    tools = [{"type": "function", "function": f} for f in functions]
    return ToolUse(parser.for_tools(tools), tools, _choice(choice, functions), parallel)


def check_functions(functions: list[dict], param: ParamOf = chat_param) -> None:
    """Unique names, and parameters that are a JSON schema llguidance compiles."""
    seen = set()
    for i, function in enumerate(functions):
        name = function["name"]
        if name in seen:
            raise InvalidRequestError(
                f"{param(i, 'name')}: {name!r} is offered twice", param=param(i, "name")
            )
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            structured.json_schema(parameters, param(i, "parameters")).check()


def _choice(name: str | None, functions: list[dict]) -> str:
    if name is None:
        return "auto"  # OpenAI's default with tools (and nothing to choose without)
    if name in ("auto", "none"):
        return name
    if not functions:
        what = "forces a call" if name == "required" else f"names {name!r}"
        raise InvalidRequestError(
            f"tool_choice {what}, but no tools are offered", param="tool_choice"
        )
    if name != "required" and name not in {f["name"] for f in functions}:
        offered = ", ".join(f["name"] for f in functions)
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
