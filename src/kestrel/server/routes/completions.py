"""POST /v1/completions."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kestrel.server.generation import Choice, Generation, new_id, sse_event, sse_response
from kestrel.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.routes.models import served_model
from kestrel.tokenizer import encode

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, http: Request):
    state = server_state(http)
    body.model = served_model(state, body.model)  # omitted: the served name
    params = body.sampling_params(state.config.default_max_tokens)
    engine = state.ready_engine()
    prompts = [encode(state.tokenizer, p) for p in body.prompts()]
    lora = state.adapter(body.model)
    kv = body.check_kv_size()
    generation = Generation(
        engine, new_id("cmpl"), prompts, params, kv, lora=lora, priority=body.priority
    )
    await generation.start()  # validates the prompts' token ids before echo decodes them
    echoes = [_echo(state, body, p) for p in body.prompts() for _ in range(params.n)]
    if body.stream:
        return sse_response(_chunks(state, body, generation, echoes), generation)
    await generation.collect(http)
    return CompletionResponse(
        id=generation.request_id,
        model=body.model,
        usage=generation.usage(),
        choices=[
            CompletionChoice(
                index=c.index,
                text=echoes[c.index] + c.text,
                logprobs=_logprobs(state, body, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
            )
            for c in generation.choices
        ],
    )


def _echo(state, body: CompletionRequest, prompt) -> str:
    if not body.echo:
        return ""
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


def _logprobs(state, body: CompletionRequest, token_ids, entries, offset: int = 0):
    """OpenAI's legacy completions log-probs: parallel lists over the generated tokens."""
    if body.logprobs is None:
        return None
    result = CompletionLogprobs()
    for token, entry in zip(token_ids, entries, strict=True):
        text = state.token_text(token)
        result.tokens.append(text)
        result.token_logprobs.append(entry[token])
        result.top_logprobs.append(
            {t.token: t.logprob for t in state.token_text.top(entry, body.logprobs)}
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def _chunks(
    state, body: CompletionRequest, generation: Generation, echoes
) -> AsyncIterator[str]:
    def chunk(choices, usage=None) -> str:
        return sse_event(
            CompletionResponse(
                id=generation.request_id, model=body.model, choices=choices, usage=usage
            )
        )

    for choice in generation.choices:
        if echoes[choice.index]:
            yield chunk([CompletionChoice(index=choice.index, text=echoes[choice.index])])
    async for choice, out in generation.outputs():
        if out.new_text or out.finished or (body.logprobs is not None and out.new_token_ids):
            offset = _offset(choice, out.new_text)
            logprobs = _logprobs(state, body, out.new_token_ids, out.new_logprobs, offset)
            yield chunk(
                [
                    CompletionChoice(
                        index=choice.index,
                        text=out.new_text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                    )
                ]
            )
    if body.include_usage:
        yield chunk([], generation.usage())


def _offset(choice: Choice, new_text: str) -> int:
    return len(choice.text) - len(new_text)
