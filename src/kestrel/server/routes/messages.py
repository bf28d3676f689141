"""POST /v1/messages: Anthropic's Messages API on the chat engine.

`system` (a string or text blocks) and `messages` (a string or content blocks: text, and image
with a base64 source for models that take images) become chat messages, generated as chat
completions are. The answer is one text block; stop_reason is end_turn, max_tokens or
stop_sequence (with the sequence, which the text leaves out, as Anthropic's). A stream sends
Anthropic's events: message_start, content_block_start, ping, content_block_delta (text_delta)...,
content_block_stop, message_delta (stop_reason, usage), message_stop. Errors on this route have
Anthropic's shape (server/errors.py); `x-api-key` is the key (server/auth.py).

Tools (kestrel.server.tools.anthropic): `tools` and `tool_choice` work as on chat completions;
the answer's calls are `tool_use` blocks after its text (stop_reason tool_use), streamed as
tool_use blocks whose input JSON comes in `input_json_delta`s; `tool_use` and `tool_result`
blocks in the conversation go back into the template as the assistant's calls and tool results.

A thinking model's reasoning (kestrel.server.reasoning) is a `thinking` block before the text;
`thinking` (enabled or disabled) goes to templates that read `enable_thinking`.

A 400 answers what is not built: image URL sources (nothing is fetched over the network), a
final assistant message (prefilling the answer), and every field not declared below. `cache_control` is accepted and changes nothing: every prompt's prefix is cached
automatically, and usage reports what was read from that cache as Anthropic does
(`cache_read_input_tokens`, beside the uncached `input_tokens`).
"""

import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.bodies import StrictBody, by_type
from kestrel.server.errors import anthropic_sse_error
from kestrel.server.generation import Choice, Generation, new_id, sse_response
from kestrel.server.prompts import ParamNames, chat_template_prompt, prompt_ids
from kestrel.server.protocol import MAX_MESSAGES, one_structured_output
from kestrel.server.reasoning import Thinking, feed, thinking_of
from kestrel.server.reasoning_output import ThinkingBlocks, ThinkingContent
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.tools.anthropic import (
    TOOL_BLOCKS,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseBlocks,
    ToolUseContent,
    add_calls,
    add_results,
    tool_use,
)
from kestrel.server.tools.output import StreamedChoice, split_answer
from kestrel.server.tools.request import ToolUse
from kestrel.server.tools.turns import Turns

router = APIRouter()

# -- request ----------------------------------------------------------------------------------


class CacheControl(StrictBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(StrictBody):
    type: Literal["base64"]  # "url" sources: nothing is fetched over the network
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class ImageBlock(StrictBody):
    type: Literal["image"]
    source: Base64Source
    cache_control: CacheControl | None = None


Block = by_type(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock)


class MessageParam(StrictBody):
    role: Literal["user", "assistant"]
    content: list[Block] | str  # lists first: pydantic's first complaint reaches the block

    def add_to(self, turns: Turns, source: str) -> None:
        """The chat messages of this turn: its tool results, its text and images, its calls."""
        blocks = self.content if isinstance(self.content, list) else []
        add_results(turns, self.role, blocks, source)
        rest = [b for b in blocks if not isinstance(b, TOOL_BLOCKS)]
        if rest or len(rest) == len(blocks):
            turns.add(self.as_chat(self.content if isinstance(self.content, str) else rest), source)
        add_calls(turns, self.role, blocks, source)

    def as_chat(self, content: list | str) -> dict:
        """The chat message; image blocks become chat's `image_url` parts, one for one."""
        if isinstance(content, list) and any(isinstance(b, ImageBlock) for b in content):
            content = [_chat_part(block) for block in content]
        elif isinstance(content, list):
            content = "".join(block.text for block in content)
        return {"role": self.role, "content": content}


def _chat_part(block: TextBlock | ImageBlock) -> dict:
    if isinstance(block, ImageBlock):
        url = f"data:{block.source.media_type};base64,{block.source.data}"
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "text", "text": block.text}


class ThinkingParam(StrictBody):
    """Extended thinking on or off: `enable_thinking` for templates that read it. The budget is
    not a separate limit: max_tokens bounds the thinking and the answer together."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class Metadata(StrictBody):
    user_id: str | None = None  # an opaque id for the provider's abuse tracking, as OpenAI's user


class MessagesRequest(StrictBody):
    model: str
    max_tokens: int
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: list[TextBlock] | str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    priority: int = 0  # vLLM's extra: lower runs sooner under --scheduling-policy priority

    def template_kwargs(self) -> dict[str, tuple]:
        if self.thinking is None:
            return {}
        return {"enable_thinking": (self.thinking.type == "enabled", "thinking")}

    def check_supported(self) -> None:
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            raise InvalidRequestError(
                "the last message must be the user's: prefilling the answer is not supported",
                param=f"messages[{last}]",
            )

    def chat_messages(self) -> tuple[list[dict], ParamNames]:
        """The chat messages and the client's name for each."""
        turns = Turns()
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            turns.add({"role": "system", "content": text}, "system")
        for i, message in enumerate(self.messages):
            message.add_to(turns, f"messages[{i}]")
        return turns.messages, ParamNames({"stop": "stop_sequences"}, turns.sources)

    def sampling_params(self, tools: ToolUse) -> SamplingParams:
        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=self.stop_sequences,
            # kept in the engine's text so that the route can tell which one matched; cut here
            include_stop_str_in_output=True,
            structured_output=one_structured_output(tools.constraints()),
        )
        return tools.sampling_params(params)


# -- response ---------------------------------------------------------------------------------


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0  # caching is automatic: nothing is "written" on request
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, generation, choice) -> "MessagesUsage":
        cached = choice.cached_tokens
        return cls(
            input_tokens=generation.prompt_tokens - cached,
            output_tokens=choice.generated_tokens,
            cache_read_input_tokens=cached,
        )


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ANTHROPIC_ERRORS = {
    status: {**doc, "model": AnthropicError} for status, doc in ERROR_RESPONSES.items()
}


# -- route ------------------------------------------------------------------------------------


@router.post("/v1/messages", response_model=MessageObject, responses=ANTHROPIC_ERRORS)
async def create_message(body: MessagesRequest, http: Request):
    state = server_state(http)
    state.check_model(body.model)
    engine = state.ready_engine()
    body.check_supported()
    tools = tool_use(state.tool_parser, body.tools, body.tool_choice)
    messages, names = body.chat_messages()
    with names.naming():
        params = body.sampling_params(tools)
        prompt = await chat_template_prompt(state, messages, tools, body.template_kwargs())
        thinking = thinking_of(state.reasoning_parser, state.tokenizer, prompt_ids(prompt))
        params = thinking.sampling_params(params)
        lora = state.adapter(body.model)
        generation = Generation(
            engine, new_id("msg"), [prompt], params, lora=lora, priority=body.priority
        )
        await generation.start()
    if body.stream:
        events = _events(body, generation, tools, thinking)
        return sse_response(events, generation, False, anthropic_sse_error)
    await generation.collect(http)
    choice = generation.choices[0]
    stop = _stop_sequence(choice, body.stop_sequences)
    parts = thinking.split(_without(choice.text, stop))
    text, calls = split_answer(parts.content, tools)
    content = [TextContent(text=text or "")] if text is not None or not calls else []
    if parts.reasoning is not None:
        content.insert(0, ThinkingContent(thinking=parts.reasoning))
    return MessageObject(
        id=generation.request_id,
        model=body.model,
        content=[*content, *(ToolUseContent.of(call) for call in calls)],
        stop_reason=_stop_reason(choice, stop, len(calls)),
        stop_sequence=stop,
        usage=MessagesUsage.of(generation, choice),
    )


def _stop_sequence(choice: Choice, stops: list[str] | None) -> str | None:
    """The stop sequence that ended the answer: the text ends with it (the engine kept it in). Of
    several that end it, the longest is the one that matched first."""
    if choice.finish_reason != "stop":
        return None
    return max((s for s in stops or () if choice.text.endswith(s)), key=len, default=None)


def _stop_reason(choice: Choice, stop: str | None, calls: int = 0) -> StopReason:
    if stop is not None:
        return "stop_sequence"
    if choice.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if calls else "end_turn"


def _without(text: str, stop: str | None) -> str:
    return text[: len(text) - len(stop)] if stop else text


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class TextBlocks:
    """The stream's text blocks: opened when text comes, closed before a tool_use block or at
    the end. `blocks` counts the message's content blocks so far."""

    def __init__(self, blocks: list):
        self.blocks, self.at = blocks, None

    def open(self) -> list[str]:
        self.at = len(self.blocks)
        self.blocks.append("text")
        return [_event("content_block_start", index=self.at, content_block=TEXT_START)]

    def add(self, text: str) -> list[str]:
        opened = self.open() if self.at is None else []
        delta = {"type": "text_delta", "text": text}
        return [*opened, _event("content_block_delta", index=self.at, delta=delta)]

    def close(self) -> list[str]:
        at, self.at = self.at, None
        return [] if at is None else [_event("content_block_stop", index=at)]


TEXT_START = {"type": "text", "text": ""}


async def _events(
    body: MessagesRequest, generation: Generation, tools: ToolUse, thinking: Thinking
) -> AsyncIterator[str]:
    start = MessageObject(
        id=generation.request_id,
        model=body.model,
        content=[],
        usage=MessagesUsage(input_tokens=generation.prompt_tokens, output_tokens=0),
    )
    yield _event("message_start", message=start.model_dump(mode="json"))
    blocks: list[str] = []
    text, calls = TextBlocks(blocks), ToolUseBlocks(_event, blocks)
    reasoning, thought = ThinkingBlocks(_event, blocks), thinking.stream()
    for event in [*([] if tools.offered or thought else text.open()), _event("ping")]:
        yield event  # without tools or thinking: one text block, opened at once
    stop, streamed = None, StreamedChoice(tools)
    async for choice, out in generation.outputs():
        delta = out.new_text
        if out.finished and (stop := _stop_sequence(choice, body.stop_sequences)):
            # the engine holds back text that may start a stop string: all of it is in this delta
            assert delta.endswith(stop), (delta, stop)
            delta = _without(delta, stop)
        thoughts, delta = feed(thought, delta, out.finished)
        content, pieces = streamed.feed(delta, out.finished)
        events = reasoning.add(thoughts) if thoughts else []
        events += reasoning.close() if content or pieces else []
        events += text.add(content) if content else []
        events += text.close() if pieces else []
        for event in events + [e for piece in pieces for e in calls.events(piece)]:
            yield event
    for event in [
        *reasoning.close(),
        *text.close(),
        *calls.close(),
        *([] if set(blocks) - {"thinking"} else [*text.open(), *text.close()]),
    ]:
        yield event
    choice = generation.choices[0]
    yield _event(
        "message_delta",
        delta={"stop_reason": _stop_reason(choice, stop, streamed.calls), "stop_sequence": stop},
        usage=MessagesUsage.of(generation, choice).model_dump(),
    )
    yield _event("message_stop")
