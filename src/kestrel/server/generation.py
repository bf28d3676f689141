"""What chat, completions and /completion share: submit n choices per prompt, collect them (or
stream them as SSE), abort on disconnect, and format log-probs."""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from kestrel.engine.client import EngineClient, GenerateRequest, OutputStream
from kestrel.engine.engine import RequestOutput
from kestrel.errors import InvalidRequestError
from kestrel.models.qwen_vl_processor import MultimodalPrompt
from kestrel.sampling import SamplingParams
from kestrel.server.errors import ClientDisconnected, sse_error
from kestrel.server.protocol import (
    CompletionTokensDetails,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger("kestrel.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """One choice's accumulated output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding's proposals, and of them accepted
    accepted_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector
    marks: list[tuple[int, int]] = field(default_factory=list)  # (characters, tokens) so far

    def add(self, output: RequestOutput) -> None:
        self.text += output.new_text
        self.token_ids += output.new_token_ids
        self.marks.append((len(self.text), len(self.token_ids)))
        self.logprobs += output.new_logprobs
        self.finish_reason = output.finish_reason
        self.prompt_tokens = output.num_prompt_tokens
        self.generated_tokens = output.num_generated_tokens
        self.cached_tokens = output.num_cached_tokens
        self.draft_tokens = output.num_draft_tokens
        self.accepted_tokens = output.num_accepted_tokens
        self.embedding = output.embedding or self.embedding

    def tokens_within(self, chars: int) -> int:
        """How many tokens the first `chars` characters of the text took (the tokens of the
        output that completed them)."""
        if chars <= 0:
            return 0
        return next((tokens for n, tokens in self.marks if n >= chars), self.generated_tokens)


class Generation:
    """The engine requests of one HTTP request: prompt i's choice j is choice index i * n + j.
    `embed`: each prompt's embedding instead of generated text (POST /v1/embeddings); `lora`:
    the LoRA adapter the request's `model` named (None: the base model); `priority`: the
    request's `priority` (vLLM's: lower runs sooner under --scheduling-policy priority)."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[list[int] | MultimodalPrompt],
        params: SamplingParams,
        max_kv_size: int | None = None,
        embed: bool = False,
        lora: str | None = None,
        priority: int = 0,
    ):
        self.engine = engine
        self.request_id = request_id
        self.constraint = params.structured_output
        self.n = params.n
        self.prompt_tokens = sum(
            len(p.token_ids if isinstance(p, MultimodalPrompt) else p) for p in prompts
        )
        self.requests = [
            GenerateRequest(
                f"{request_id}-{i * params.n + j}",
                prompt,
                params.for_choice(j),
                max_kv_size,
                embed,
                lora,
                priority,
            )
            for i, prompt in enumerate(prompts)
            for j in range(params.n)
        ]
        self.index = {r.request_id: k for k, r in enumerate(self.requests)}
        self.choices = [Choice(k) for k in range(len(self.requests))]
        self.stream: OutputStream | None = None

    async def start(self) -> None:
        self.stream = await self.engine.add(self.requests)

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each output with its choice (updated); raises the first request error."""
        async for output in self.stream:
            if output.error is not None:
                log.error("request %s failed: %r", output.request_id, output.error)
                raise self._failure(output.error)
            choice = self.choices[self.index[output.request_id]]
            choice.add(output)
            yield choice, output

    def _failure(self, error: BaseException) -> BaseException:
        """The error to answer with. The grammar engine's failures are ValueErrors (in the
        engine process: an EngineError naming one); llguidance fails mid-output on some strings
        with some tokenizers (a choice of one unassigned code point, with SmolLM2's), so that
        is the constraint's fault: a 400 naming its field, not a 500."""
        text = str(error)
        grammar = isinstance(error, ValueError) or text.startswith("ValueError:")
        if self.constraint is None or not grammar:
            return error
        param = self.constraint.param
        message = f"{param}: the output could not be kept to this constraint ({text})"
        return InvalidRequestError(message, param=param)

    async def collect(self, http: Request) -> list[Choice]:
        """Run to the end; abort (and raise ClientDisconnected) if the client leaves first."""
        try:
            await until_disconnect(http, self._drain())
        finally:
            self.abort()
        return self.choices

    async def _drain(self) -> None:
        async for _ in self.outputs():
            pass

    def abort(self) -> None:
        if self.stream is not None:
            self.engine.abort(self.stream)

    def usage(self, reasoning_tokens: int | None = None) -> Usage:
        """`reasoning_tokens`: the thinking's, with a reasoning parser."""
        completion = sum(c.generated_tokens for c in self.choices)
        # each prompt counts once (as prompt_tokens does): its first choice's hit
        cached = sum(c.cached_tokens for c in self.choices[:: self.n])
        drafted = sum(c.draft_tokens for c in self.choices)
        accepted = sum(c.accepted_tokens for c in self.choices)
        details = None
        if drafted or reasoning_tokens is not None:
            details = CompletionTokensDetails(
                accepted_prediction_tokens=accepted,
                rejected_prediction_tokens=drafted - accepted,
                reasoning_tokens=reasoning_tokens or 0,
            )
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=details,
        )


async def until_disconnect(http: Request, work: Awaitable) -> None:
    """Await `work` unless the client disconnects first (then cancel it, raise ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected(f"the client left ({http.url.path})")
    task.result()


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


# (error, request id) -> the SSE event that ends a failed stream, in the route's API's shape
ErrorEvent = Callable[[BaseException, str], str]


def sse_response(
    events: AsyncIterator[str],
    generation: Generation,
    done: bool = True,
    error_event: ErrorEvent = sse_error,
) -> StreamingResponse:
    return StreamingResponse(
        _sse(events, generation, done, error_event),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


async def _sse(
    events: AsyncIterator[str], generation: Generation, done: bool, error_event: ErrorEvent
) -> AsyncIterator[str]:
    """Events, then `[DONE]` (chat and completions); a failure becomes an error event. A client
    that leaves cancels this generator (Starlette watches for the disconnect); the finally aborts."""
    try:
        async for event in events:
            yield event
    except Exception as error:
        yield error_event(error, generation.request_id)
    finally:
        generation.abort()
    if done:
        yield "data: [DONE]\n\n"


def sse_event(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class TokenText:
    """Token id -> its text and bytes, for log-probs (cached: the vocabulary is fixed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token])
        return self.cache[token]

    def top(self, entry: dict[int, float], k: int) -> list[TopLogprob]:
        best = sorted(entry.items(), key=lambda item: -item[1])[:k]
        return [self.top_logprob(token, logprob) for token, logprob in best]

    def top_logprob(self, token: int, logprob: float) -> TopLogprob:
        text = self(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def chat(
        self, token_ids: list[int], entries: list[dict[int, float]], k: int
    ) -> list[TokenLogprob]:
        """OpenAI chat `logprobs.content`: the sampled token and the top k at each step."""
        return [
            TokenLogprob(
                **self.top_logprob(token, entry[token]).model_dump(),
                top_logprobs=self.top(entry, k),
            )
            for token, entry in zip(token_ids, entries, strict=True)
        ]
