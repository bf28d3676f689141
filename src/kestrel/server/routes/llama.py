"""llama-server's native routes: POST /completion, /tokenize, /detokenize."""

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kestrel.errors import InvalidRequestError
from kestrel.server.generation import Choice, Generation, new_id, sse_response
from kestrel.server.protocol import DetokenizeRequest, LlamaCompletionRequest, TokenizeRequest
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.tokenizer import encode

router = APIRouter()

STOP_TYPES = {"stop": "eos", "length": "limit"}


@router.post("/completion", responses=ERROR_RESPONSES)
async def completion(body: LlamaCompletionRequest, http: Request):
    state = server_state(http)
    params = body.sampling_params(state.config.default_max_tokens)
    engine = state.ready_engine()
    generation = Generation(engine, new_id("cmpl"), [encode(state.tokenizer, body.prompt)], params)
    await generation.start()
    if body.stream:
        return sse_response(_events(state, generation), generation, done=False)
    await generation.collect(http)
    return _summary(state, generation, generation.choices[0], content=generation.choices[0].text)


def _summary(state, generation: Generation, choice: Choice, content: str) -> dict:
    return {
        "content": content,
        "stop": True,
        "model": state.config.model_name,
        "tokens_predicted": choice.generated_tokens,
        "tokens_evaluated": generation.prompt_tokens,
        "stop_type": STOP_TYPES.get(choice.finish_reason, choice.finish_reason),
        "truncated": False,
    }


async def _events(state, generation: Generation) -> AsyncIterator[str]:
    async for choice, out in generation.outputs():
        if out.finished:
            body = _summary(state, generation, choice, content=out.new_text)
        else:
            body = {"content": out.new_text, "stop": False}
        yield f"data: {json.dumps(body)}\n\n"


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, http: Request) -> dict:
    state = server_state(http)
    state.ready_engine()
    tokenizer = state.tokenizer
    return {"tokens": tokenizer.encode(body.content, add_special_tokens=body.add_special)}


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, http: Request) -> dict:
    state = server_state(http)
    state.ready_engine()
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
    return {"content": state.tokenizer.decode(body.tokens)}
