"""POST /v1/embeddings (OpenAI's Embeddings API). Each input is its own engine request, so a list
of inputs runs batched, beside the generations; its vector is the prompt's final-norm hidden
state pooled as --pooling says (the last token's, or the mean) and L2-normalized."""

import base64
import struct

from fastapi import APIRouter, Request

from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.generation import Generation, new_id
from kestrel.server.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.routes.models import served_model
from kestrel.tokenizer import encode

router = APIRouter()


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, http: Request):
    state = server_state(http)
    body.model = served_model(state, body.model)  # omitted: the served name
    engine = state.ready_engine()
    inputs = body.inputs()
    _check(body, len(inputs), engine.embedding_size, engine.capacity)
    prompts = [encode(state.tokenizer, text) for text in inputs]
    lora = state.adapter(body.model)
    params = SamplingParams()
    generation = Generation(
        engine, new_id("embd"), prompts, params, embed=True, lora=lora, priority=body.priority
    )
    await generation.start()
    await generation.collect(http)
    return EmbeddingResponse(
        data=[
            Embedding(embedding=_encoded(c.embedding, body.encoding_format), index=c.index)
            for c in generation.choices
        ],
        model=body.model,
        usage=EmbeddingUsage(
            prompt_tokens=generation.prompt_tokens, total_tokens=generation.prompt_tokens
        ),
    )


def _check(body: EmbeddingRequest, num_inputs: int, size: int | None, capacity: int) -> None:
    """`dimensions` can only be the model's own (vectors are not truncated), and every input must
    fit in the engine at once."""
    if body.dimensions is not None and body.dimensions != size:
        raise InvalidRequestError(
            f"dimensions must be the model's embedding size ({size}): vectors are not truncated",
            param="dimensions",
        )
    if num_inputs > capacity:
        raise InvalidRequestError(
            f"{num_inputs} inputs exceed the server's capacity ({capacity}); send fewer at once",
            param="input",
        )


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
