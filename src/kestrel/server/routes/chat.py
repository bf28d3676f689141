"""POST /v1/chat/completions."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kestrel.server.generation import Generation, new_id, sse_event, sse_response
from kestrel.server.prompts import chat_template_prompt
from kestrel.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    Delta,
)
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.routes.models import served_model

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES
)
async def chat_completions(body: ChatCompletionRequest, http: Request):
    state = server_state(http)
    body.model = served_model(state, body.model)  # omitted: the served name
    params = body.sampling_params(state.config.default_max_tokens)
    engine = state.ready_engine()
    prompt = await chat_template_prompt(state, [m.as_template_dict() for m in body.messages])
    generation = Generation(engine, new_id("chatcmpl"), [prompt], params, body.check_kv_size())
    await generation.start()
    if body.stream:
        return sse_response(_chunks(state, body, generation), generation)
    await generation.collect(http)
    return ChatCompletionResponse(
        id=generation.request_id,
        model=body.model,
        usage=generation.usage(),
        choices=[
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=_logprobs(state, body, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
            )
            for c in generation.choices
        ],
    )


def _logprobs(state, body: ChatCompletionRequest, token_ids, entries) -> ChoiceLogprobs | None:
    if not body.logprobs:
        return None
    return ChoiceLogprobs(content=state.token_text.chat(token_ids, entries, body.top_logprobs or 0))


async def _chunks(state, body: ChatCompletionRequest, generation: Generation) -> AsyncIterator[str]:
    """A role chunk per choice, content deltas, a final chunk with finish_reason, then usage."""

    def chunk(choices, usage=None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=generation.request_id, model=body.model, choices=choices, usage=usage
            )
        )

    for choice in generation.choices:
        yield chunk(
            [ChatChunkChoice(index=choice.index, delta=Delta(role="assistant", content=""))]
        )
    async for choice, out in generation.outputs():
        if out.new_text or (body.logprobs and out.new_token_ids):
            logprobs = _logprobs(state, body, out.new_token_ids, out.new_logprobs)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=choice.index, delta=Delta(content=out.new_text), logprobs=logprobs
                    )
                ]
            )
        if out.finished:
            yield chunk(
                [
                    ChatChunkChoice(
                        index=choice.index, delta=Delta(), finish_reason=out.finish_reason
                    )
                ]
            )
    if body.include_usage:
        yield chunk([], generation.usage())
