"""OpenAI's deprecated functions API on chat completions, as OpenAI answered it, mapped onto tools.

`functions` are function tools and `function_call` ("none", "auto", `{"name"}`) their choice; a
named function is forced by the grammar as a named tool choice is. One call at most (the old API
had no parallel calls): the answer's is `message.function_call` (`name`, `arguments`) with
`finish_reason` "function_call", streamed as `delta.function_call` pieces (the name first, then
the arguments as they are generated). In the conversation an assistant `function_call` is a tool
call and a `function` message (`name`, `content`) the result of the latest call of that name.
"""

from kestrel.errors import InvalidRequestError
from kestrel.server.protocol import AssistantMessage, DeltaFunction, NamedFunction
from kestrel.server.tools.parsers import ToolParser
from kestrel.server.tools.request import ToolUse, offer
from kestrel.server.tools.turns import Turns


def uses_functions(body) -> bool:
    """The request uses the old form (`functions: []` and a choice of auto or none are off)."""
    return bool(body.functions) or isinstance(body.function_call, NamedFunction)


def functions_tool_use(body, parser: ToolParser) -> ToolUse:
    """The ToolUse of `functions` and `function_call`; tools and functions together are a 400."""
    if body.tools is not None or body.tool_choice is not None:
        raise InvalidRequestError(
            "functions: set tools (and tool_choice) or the deprecated functions (and "
            "function_call), not both",
            param="functions",
        )
    choice = body.function_call
    name = choice.name if isinstance(choice, NamedFunction) else choice
    functions = [f.model_dump(exclude_none=True) for f in body.functions or ()]
    try:
        return offer(parser, functions, name, False, lambda i, field: f"functions[{i}].{field}")
    except InvalidRequestError as error:  # the choice's errors name tool_choice
        if error.param != "tool_choice":
            raise
        message = str(error).replace("tool_choice", "function_call", 1)
        raise InvalidRequestError(message, param="function_call") from None


def as_tool_turns(messages: list[dict]) -> list[dict]:
    """Chat template messages with `function_call` turns as tool calls (ids made up) and
    `function` turns as the tool results of the latest call of their name."""
    if not any("function_call" in m or m["role"] == "function" for m in messages):
        return messages
    turns, latest = Turns(), {}
    for i, message in enumerate(messages):
        source = f"messages[{i}]"
        if message["role"] == "function":
            _result(turns, latest, message, source)
            continue
        call = message.get("function_call")
        if call is not None and message["role"] != "assistant":
            param = f"{source}.function_call"
            raise InvalidRequestError(f"{param}: only assistant messages make calls", param=param)
        turns.add({k: v for k, v in message.items() if k != "function_call"}, source)
        if call is not None:
            latest[call["name"]] = f"call_function_{i}"
            turns.call(latest[call["name"]], call["name"], call["arguments"], source, source)
    return turns.messages


def _result(turns: Turns, latest: dict[str, str], message: dict, source: str) -> None:
    name = message.get("name")
    if name not in latest:
        param = f"{source}.name"
        raise InvalidRequestError(
            f"{param}: a function message answers an earlier function_call of that name "
            f"({name!r} has none)",
            param=param,
        )
    turns.result(latest[name], message["content"], source, f"{source}.name")


def as_function_call(message: AssistantMessage) -> AssistantMessage:
    """The answer in the old shape: its (one) call as `function_call`."""
    calls = message.tool_calls or []
    call = calls[0].function if calls else None
    return AssistantMessage(
        content=message.content, function_call=call, reasoning_content=message.reasoning_content
    )


def function_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason


def function_delta(deltas: list) -> DeltaFunction | None:
    """Chat's `delta.tool_calls` pieces as a `delta.function_call` piece: the first call's, as
    `as_function_call` keeps (the old shape holds one)."""
    deltas = [d for d in deltas if d.index == 0]
    if not deltas:
        return None
    name = next((d.function.name for d in deltas if d.function.name is not None), None)
    return DeltaFunction(name=name, arguments="".join(d.function.arguments or "" for d in deltas))
