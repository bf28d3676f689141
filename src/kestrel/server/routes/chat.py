"""POST /v1/chat/completions (tool calls: kestrel.server.tools; the deprecated functions:
kestrel.server.tools.legacy)."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kestrel.server.generation import Choice, Generation, new_id, sse_event, sse_response
from kestrel.server.prompts import chat_template_prompt, prompt_ids
from kestrel.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    Delta,
    DeltaToolCall,
)
from kestrel.server.reasoning import Thinking, feed, thinking_of
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.routes.models import served_model
from kestrel.server.tools.legacy import (
    as_function_call,
    as_tool_turns,
    function_delta,
    function_reason,
    functions_tool_use,
    uses_functions,
)
from kestrel.server.tools.output import StreamedChoice, assistant_message, finish_reason
from kestrel.server.tools.request import ToolUse, check_tool_messages, tool_use

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES
)
async def chat_completions(body: ChatCompletionRequest, http: Request):
    state = server_state(http)
    body.model = served_model(state, body.model)  # omitted: the served name
    engine = state.ready_engine()
    legacy = uses_functions(body)
    tools = (functions_tool_use if legacy else tool_use)(body, state.tool_parser)
    params = _sampling_params(state, body, tools)
    messages = [m.as_template_dict(f"messages[{i}].") for i, m in enumerate(body.messages)]
    check_tool_messages(body.messages)
    turns = as_tool_turns(messages)
    prompt = await chat_template_prompt(state, turns, tools, body.template_kwargs())
    thinking = thinking_of(state.reasoning_parser, state.tokenizer, prompt_ids(prompt))
    params = thinking.sampling_params(params)
    lora = state.adapter(body.model)
    kv = body.check_kv_size()
    generation = Generation(
        engine, new_id("chatcmpl"), [prompt], params, kv, lora=lora, priority=body.priority
    )
    await generation.start()
    if body.stream:
        chunks = _chunks(state, body, generation, tools, legacy, thinking)
        return sse_response(chunks, generation)
    await generation.collect(http)
    answers = [_choice(state, body, c, thinking, tools, legacy) for c in generation.choices]
    reasoning_tokens = sum(tokens for _, tokens in answers) if thinking.on else None
    return ChatCompletionResponse(
        id=generation.request_id,
        model=body.model,
        usage=generation.usage(reasoning_tokens),
        choices=[choice for choice, _ in answers],
    )


def _choice(
    state, body: ChatCompletionRequest, c: Choice, thinking: Thinking, tools: ToolUse, legacy: bool
) -> tuple[ChatChoice, int]:
    """A whole choice's message, and how many tokens its thinking took."""
    parts = thinking.split(c.text)
    message, calls = assistant_message(parts.content, tools)
    message.reasoning_content = parts.reasoning
    if parts.reasoning is not None and not message.content:  # all thinking: no content
        message.content = None
    logprobs = _logprobs(state, body, c.token_ids, c.logprobs)
    reason = finish_reason(c.finish_reason, calls)
    if legacy:
        message, reason = as_function_call(message), function_reason(reason)
    choice = ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=reason)
    return choice, c.tokens_within(parts.reasoning_chars)


def _sampling_params(state, body: ChatCompletionRequest, tools: ToolUse):
    return tools.sampling_params(
        body.sampling_params(state.config.default_max_tokens, tools.constraints())
    )


def _logprobs(state, body: ChatCompletionRequest, token_ids, entries) -> ChoiceLogprobs | None:
    if not body.logprobs:
        return None
    return ChoiceLogprobs(content=state.token_text.chat(token_ids, entries, body.top_logprobs or 0))


async def _chunks(
    state,
    body: ChatCompletionRequest,
    generation: Generation,
    tools: ToolUse,
    legacy: bool,
    thinking: Thinking,
) -> AsyncIterator[str]:
    """A role chunk per choice, reasoning, content and tool-call deltas, a final chunk with
    finish_reason, then usage."""

    def chunk(choices, usage=None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=generation.request_id, model=body.model, choices=choices, usage=usage
            )
        )

    streams = [StreamedChoice(tools) for _ in generation.choices]
    thoughts = [thinking.stream() for _ in generation.choices]
    for choice in generation.choices:
        yield chunk(
            [ChatChunkChoice(index=choice.index, delta=Delta(role="assistant", content=""))]
        )
    async for choice, out in generation.outputs():
        stream = streams[choice.index]
        reasoning, text = feed(thoughts[choice.index], out.new_text, out.finished)
        if reasoning:
            delta = Delta(reasoning_content=reasoning)
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta)])
        content, calls = stream.chat_deltas(text, out.finished)
        if content or (body.logprobs and out.new_token_ids):
            logprobs = _logprobs(state, body, out.new_token_ids, out.new_logprobs)
            delta = Delta(content=content)
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs)])
        for delta in _call_deltas(calls, legacy):
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta)])
        if out.finished:
            reason = finish_reason(out.finish_reason, stream.calls)
            reason = function_reason(reason) if legacy else reason
            yield chunk([ChatChunkChoice(index=choice.index, delta=Delta(), finish_reason=reason)])
    if body.include_usage:
        yield chunk([], generation.usage(_reasoning_tokens(generation, thoughts)))


def _reasoning_tokens(generation: Generation, thoughts: list) -> int | None:
    """The thinking's tokens over all choices (None without a reasoning parser)."""
    if not thoughts or thoughts[0] is None:
        return None
    return sum(
        c.tokens_within(t.reasoning_chars)
        for c, t in zip(generation.choices, thoughts, strict=True)
    )


def _call_deltas(calls: list[DeltaToolCall], legacy: bool) -> list[Delta]:
    if legacy:
        return [Delta(function_call=piece)] if (piece := function_delta(calls)) else []
    return [Delta(tool_calls=[call]) for call in calls]
