"""POST /v1/responses: OpenAI's Responses API on the chat engine; GET and DELETE of kept responses.

The input (a string, or messages of `input_text` / `input_image` / `output_text` parts) and the
`instructions` become chat messages, generated as chat completions are; the answer is one assistant
`message` output item. A stream sends OpenAI's event sequence (response.created, .in_progress,
.output_item.added, .content_part.added, .output_text.delta..., .output_text.done,
.content_part.done, .output_item.done, then response.completed, or response.incomplete when
max_output_tokens cut the answer), each event with its sequence_number.

State: the server keeps its last MAX_KEPT finished responses with `store: true` (the default) in
memory, least recently used dropped first, for `previous_response_id` and GET /v1/responses/{id}.
Nothing survives a restart; an unknown or dropped id is a 400 naming previous_response_id.
Unknown fields (include, background, ...) are a 400 naming them. `text.format`
json_schema and json_object constrain the answer.

Function tools (kestrel.server.tools.responses): `tools`, `tool_choice`, `parallel_tool_calls`
work as on chat completions; the answer's calls are `function_call` output items after the message
item (which is left out when the answer is only calls), and `function_call` /
`function_call_output` input items go back into the template as the assistant's calls and tool
results.

A thinking model's reasoning (kestrel.server.reasoning) is a `reasoning` item before the message
(kestrel.server.reasoning_output); `reasoning.effort` goes to templates that read
`reasoning_effort`, and usage counts the thinking's tokens in `output_tokens_details`.
"""

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kestrel import structured
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.bodies import StrictBody, by_type
from kestrel.server.errors import APIError, as_api_error
from kestrel.server.generation import Choice, Generation, new_id, sse_response
from kestrel.server.prompts import ParamNames, chat_template_prompt, prompt_ids
from kestrel.server.protocol import MAX_MESSAGES, one_structured_output
from kestrel.server.reasoning import Thinking, feed, thinking_of
from kestrel.server.reasoning_output import ReasoningItem, ReasoningItems, ReasoningText
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.tools.output import StreamedChoice, split_answer
from kestrel.server.tools.parsers import ToolParser
from kestrel.server.tools.request import ToolUse
from kestrel.server.tools.responses import (
    CallItems,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionToolParam,
    ToolChoice,
    tool_use,
)
from kestrel.server.tools.turns import Turns
from kestrel.structured import StructuredOutput

router = APIRouter()

MAX_KEPT = 128  # finished responses kept for previous_response_id (their images included)

# chat completions' parameter names -> this API's (errors name what the client sent)
RENAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


# -- request ----------------------------------------------------------------------------------


class InputTextPart(StrictBody):
    type: Literal["input_text"]
    text: str


class InputImagePart(StrictBody):
    type: Literal["input_image"]
    image_url: str  # data:image/...;base64,... or file:// under --allowed-local-media-path
    detail: Literal["low", "high", "auto", "original"] = "auto"  # as chat's: one resolution


class OutputTextPart(StrictBody):
    """An earlier answer sent back as an assistant turn (annotations and logprobs are output)."""

    type: Literal["output_text"]
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list | None = None


InputPart = by_type(InputTextPart, InputImagePart, OutputTextPart)


class InputMessage(StrictBody):
    """A message (`type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputPart] | str  # list first: see ResponsesRequest.input
    id: str | None = None  # an earlier response's output item sent back carries these two
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def as_chat(self) -> dict:
        """The chat message; image parts become chat's `image_url` parts, one for one."""
        role = "system" if self.role == "developer" else self.role
        content = self.content
        if isinstance(content, list) and any(isinstance(p, InputImagePart) for p in content):
            content = [_chat_part(part) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": role, "content": content}

    def add_to(self, turns: Turns, source: str) -> None:
        turns.add(self.as_chat(), source)


class ReasoningInputItem(StrictBody):
    """An earlier answer's reasoning item, sent back with its output: chat templates drop the
    thinking of earlier turns, so it adds nothing to the prompt."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = Field(default_factory=list)
    content: list | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def add_to(self, turns: Turns, source: str) -> None:
        pass


InputItem = by_type(
    InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningInputItem, default="message"
)


def _chat_part(part: InputTextPart | InputImagePart | OutputTextPart) -> dict:
    if isinstance(part, InputImagePart):
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text}


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")  # BaseModel has a `schema` method
    strict: bool | None = None  # every schema is enforced

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object", param="text.format")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError(
                    "text.format.schema is required with type json_schema",
                    param="text.format.schema",
                )
            return structured.json_schema(self.json_schema, "text.format.schema")
        return None


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ReasoningConfig(StrictBody):
    """`effort` goes to chat templates that read `reasoning_effort` (a 400 where none does)."""

    effort: str | None = None


class ResponsesRequest(StrictBody):
    model: str
    # lists first: pydantic's first complaint (the one a 400 names) is then the list's, whose
    # path reaches the bad item (`input[2].content[0]`)
    input: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)] | str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    priority: int = 0  # vLLM's: lower runs sooner under --scheduling-policy priority

    def template_kwargs(self) -> dict[str, tuple]:
        effort = self.reasoning and self.reasoning.effort
        return {"reasoning_effort": (effort, "reasoning.effort")} if effort else {}

    def tool_use(self, parser: ToolParser) -> ToolUse:
        return tool_use(parser, self.tools, self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self, default_max_tokens: int | None, tools: ToolUse) -> SamplingParams:
        constraints = [*self._constraints(), *tools.constraints()]
        params = SamplingParams(
            max_tokens=(
                default_max_tokens if self.max_output_tokens is None else self.max_output_tokens
            ),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            structured_output=one_structured_output(constraints),
        )
        return tools.sampling_params(params)

    def _constraints(self) -> list[StructuredOutput]:
        text_format = self.text and self.text.format
        return list(filter(None, [text_format and text_format.structured_output()]))


# -- response ---------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallOutput]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict = "auto"
    tools: list = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# -- kept responses ---------------------------------------------------------------------------


@dataclass
class Kept:
    response: ResponseObject
    conversation: list[dict]  # its chat messages, answer included, instructions not


class ResponseStore:
    """Finished responses by id; past `capacity`, the least recently used is dropped."""

    def __init__(self, capacity: int = MAX_KEPT):
        self.capacity = capacity
        self.entries: OrderedDict[str, Kept] = OrderedDict()

    def get(self, response_id: str) -> Kept | None:
        kept = self.entries.get(response_id)
        if kept is not None:
            self.entries.move_to_end(response_id)
        return kept

    def put(self, kept: Kept) -> None:
        self.entries[kept.response.id] = kept
        self.entries.move_to_end(kept.response.id)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None


def response_store(http: Request) -> ResponseStore:
    """The app's store (made on first use; one event loop, so no lock)."""
    app_state = http.app.state
    if not hasattr(app_state, "responses"):
        app_state.responses = ResponseStore()
    return app_state.responses


# -- routes -----------------------------------------------------------------------------------


@router.post("/v1/responses", response_model=ResponseObject, responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, http: Request):
    state = server_state(http)
    state.check_model(body.model)
    engine = state.ready_engine()
    tools = body.tool_use(state.tool_parser)
    store = response_store(http)
    history = _history(store, body.previous_response_id)
    messages, names = _conversation(body, history)
    with names.naming():
        params = body.sampling_params(state.config.default_max_tokens, tools)
        prompt = await chat_template_prompt(state, messages, tools, body.template_kwargs())
        thinking = thinking_of(state.reasoning_parser, state.tokenizer, prompt_ids(prompt))
        params = thinking.sampling_params(params)
        lora = state.adapter(body.model)
        generation = Generation(
            engine, new_id("resp"), [prompt], params, lora=lora, priority=body.priority
        )
        await generation.start()
    conversation = messages[1:] if body.instructions is not None else messages
    answer = Answer(body, generation, conversation, tools, thinking)
    if body.stream:
        return sse_response(_events(answer, store), generation, False, answer.events.error)
    await generation.collect(http)
    answer.collected()
    return answer.finish(store)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERROR_RESPONSES)
async def retrieve_response(response_id: str, http: Request):
    kept = response_store(http).get(response_id)
    if kept is None:
        raise _not_kept(response_id)
    return kept.response


@router.delete(
    "/v1/responses/{response_id}", response_model=DeletedResponse, responses=ERROR_RESPONSES
)
async def delete_response(response_id: str, http: Request):
    if not response_store(http).delete(response_id):
        raise _not_kept(response_id)
    return DeletedResponse(id=response_id)


def _not_kept(response_id: str) -> APIError:
    return APIError(
        404, f"no response with id {response_id!r} is kept", param="response_id", code="not_found"
    )


def _history(store: ResponseStore, previous_id: str | None) -> list[dict]:
    if previous_id is None:
        return []
    kept = store.get(previous_id)
    if kept is None:
        raise InvalidRequestError(
            f"no response with id {previous_id!r} is kept (responses live in the server's memory, "
            f"the last {store.capacity} with store: true)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return kept.conversation


def _conversation(body: ResponsesRequest, history: list[dict]) -> tuple[list[dict], ParamNames]:
    """The chat messages (instructions, the previous conversation, the input) and the client's
    name for each. As OpenAI's, a previous response's instructions are not carried over."""
    turns = Turns()
    if body.instructions is not None:
        turns.add({"role": "system", "content": body.instructions}, "instructions")
    for message in history:
        turns.add(message, "previous_response_id")
    if isinstance(body.input, str):
        turns.add({"role": "user", "content": body.input}, "input")
    else:
        for i, item in enumerate(body.input):
            item.add_to(turns, f"input[{i}]")
    return turns.messages, ParamNames(RENAMES, turns.sources)


# -- the answer -------------------------------------------------------------------------------


class Events:
    """The stream's SSE events, numbered in order."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def error(self, error: BaseException, request_id: str) -> str:
        api_error = as_api_error(error, request_id)
        return self("error", code=api_error.code, message=str(api_error), param=api_error.param)


@dataclass
class Answer:
    """One response as it is generated: its output items, its objects at each stage, and keeping
    it at the end."""

    body: ResponsesRequest
    generation: Generation
    conversation: list[dict]  # the chat messages this response continues, instructions not
    tools: ToolUse
    thinking: Thinking
    created_at: int = field(default_factory=lambda: int(time.time()))
    events: Events = field(default_factory=Events)
    output: list[ReasoningItem | OutputMessage | FunctionCallOutput] = field(default_factory=list)
    reasoning_chars: int = 0  # how much of the text the thinking took

    @property
    def choice(self) -> Choice:
        return self.generation.choices[0]

    def response(self, status: str = "in_progress", output=(), usage=None) -> ResponseObject:
        body = self.body
        return ResponseObject(
            id=self.generation.request_id,
            created_at=self.created_at,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=body.model,
            output=list(output),
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            store=body.store,
            temperature=body.temperature,
            top_p=body.top_p,
            tool_choice=_choice_echo(body.tool_choice),
            tools=[_dump(tool) for tool in body.tools or ()],
            metadata=body.metadata or {},
            usage=usage,
            **(
                {"text": body.text.model_dump(by_alias=True, exclude_none=True)}
                if body.text
                else {}
            ),
        )

    def status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def collected(self) -> None:
        """The output items of the whole answer: its reasoning, its text (none beside calls
        only), its calls."""
        parts = self.thinking.split(self.choice.text)
        self.reasoning_chars = parts.reasoning_chars
        if parts.reasoning is not None:
            content = [ReasoningText(text=parts.reasoning)]
            self.output.append(ReasoningItem(content=content, status=self.status()))
        content, calls = split_answer(parts.content, self.tools)
        if content is not None or not calls:
            text = [OutputText(text=content or "")]
            self.output.append(OutputMessage(id=new_id("msg"), status=self.status(), content=text))
        self.output += [FunctionCallOutput.of(call) for call in calls]

    def finish(self, store: ResponseStore) -> ResponseObject:
        """The finished response, kept when the request asked for it."""
        usage = self.generation.usage()
        response = self.response(
            self.status(),
            self.output,
            ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details={"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                output_tokens=usage.completion_tokens,
                output_tokens_details={
                    "reasoning_tokens": self.choice.tokens_within(self.reasoning_chars)
                },
                total_tokens=usage.total_tokens,
            ),
        )
        if self.body.store:
            store.put(Kept(response, [*self.conversation, self.chat_message()]))
        return response

    def chat_message(self) -> dict:
        """The answer as the next turn's template sees it (whole calls only)."""
        items = self.output
        text = "".join(p.text for i in items if isinstance(i, OutputMessage) for p in i.content)
        calls = [
            i.as_template_call()
            for i in items
            if isinstance(i, FunctionCallOutput) and i.status == "completed"
        ]
        return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})


def _choice_echo(choice) -> str | dict:
    return _dump(choice) if isinstance(choice, BaseModel) else choice or "auto"


class TextItem:
    """The stream's message items: opened when text comes, closed before a call or at the end."""

    def __init__(self, event: Events, output: list):
        self.event, self.output = event, output
        self.item: OutputMessage | None = None

    def open(self) -> list[str]:
        self.item = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        self.output.append(self.item)
        ids = self._ids()
        added = self.event(
            "response.output_item.added", output_index=ids["output_index"], item=_dump(self.item)
        )
        self.item.content.append(OutputText(text=""))
        part = self.event("response.content_part.added", **ids, part=_dump(OutputText(text="")))
        return [added, part]

    def add(self, delta: str) -> list[str]:
        opened = self.open() if self.item is None else []
        self.item.content[0].text += delta
        more = self.event("response.output_text.delta", **self._ids(), delta=delta, logprobs=[])
        return [*opened, more]

    def close(self, status: str) -> list[str]:
        if self.item is None:
            return []
        ids, part = self._ids(), self.item.content[0]
        self.item.status = status
        events = [
            self.event("response.output_text.done", **ids, text=part.text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=_dump(part)),
            self.event(
                "response.output_item.done", output_index=ids["output_index"], item=_dump(self.item)
            ),
        ]
        self.item = None
        return events

    def _ids(self) -> dict:
        at = self.output.index(self.item)
        return {"item_id": self.item.id, "output_index": at, "content_index": 0}


async def _events(answer: Answer, store: ResponseStore) -> AsyncIterator[str]:
    """created, in_progress, the output items' events as the answer is generated, then
    completed (or incomplete)."""
    event = answer.events
    yield event("response.created", response=_dump(answer.response()))
    yield event("response.in_progress", response=_dump(answer.response()))
    choice, thought = StreamedChoice(answer.tools), answer.thinking.stream()
    text, calls = TextItem(event, answer.output), CallItems(event, answer.output)
    reasoning = ReasoningItems(event, answer.output)
    # no tools: always one message (after the reasoning item, when there may be one)
    for e in [] if answer.tools.offered or thought else text.open():
        yield e
    async for _, out in answer.generation.outputs():
        thoughts, delta = feed(thought, out.new_text, out.finished)
        content, pieces = choice.feed(delta, out.finished)
        events = reasoning.add(thoughts) if thoughts else []
        events += reasoning.close() if content or pieces else []
        events += text.add(content) if content else []
        events += text.close("completed") if pieces else []
        for e in events + [e for piece in pieces for e in calls.events(piece)]:
            yield e
    for e in [*reasoning.close(answer.status()), *text.close(answer.status()), *calls.close()]:
        yield e
    answer.reasoning_chars = thought.reasoning_chars if thought else 0
    if not any(isinstance(item, OutputMessage | FunctionCallOutput) for item in answer.output):
        for e in [*text.open(), *text.close(answer.status())]:  # as when not streamed
            yield e
    response = answer.finish(store)
    yield event(f"response.{response.status}", response=_dump(response))


def _dump(model: BaseModel) -> dict:
    return model.model_dump(mode="json")
