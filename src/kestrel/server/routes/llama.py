"""llama-server's native routes, as its README's route reference documents them: POST
/completion, /tokenize, /detokenize, /apply-template; GET /props and /slots."""

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import cache

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import kestrel
from kestrel.engine.engine import RequestOutput
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.generation import Choice, Generation, new_id, sse_response, until_disconnect
from kestrel.server.protocol import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    ImagePart,
    LlamaCompletionRequest,
    LlamaPrompt,
    TokenizeRequest,
)
from kestrel.server.routes import ERROR_RESPONSES, server_state
from kestrel.server.state import ServerState
from kestrel.server.tools.legacy import as_tool_turns
from kestrel.server.tools.prompt import template_messages
from kestrel.server.tools.request import check_tool_messages, tool_use
from kestrel.tokenizer import encode

router = APIRouter()

STOP_TYPES = {"stop": "eos", "length": "limit"}

# llama-server's own error bodies (not OpenAI's) for these two routes
SLOTS_OFF = {
    "code": 501,
    "message": "This server does not support slots endpoint. Start it with `--slots`",
    "type": "not_supported_error",
}
NO_SLOT = {"code": 503, "message": "no slot available", "type": "unavailable_error"}


# -- POST /completion -----------------------------------------------------------------------------


@router.post("/completion", responses=ERROR_RESPONSES)
async def completion(body: LlamaCompletionRequest, http: Request):
    """One result, or a list of them for a list of prompts or n_cmpl > 1 (each prompt's n_cmpl
    in order)."""
    state = server_state(http)
    engine = state.ready_engine()
    params = body.sampling_params(state.config.default_max_tokens, state.tokenizer)
    prompts, several = body.prompts()
    token_ids = [prompt_tokens(state.tokenizer, prompt) for prompt in prompts]
    run = _Run(state, body, params, Generation(engine, new_id("cmpl"), token_ids, params))
    await run.generation.start()
    if body.stream:
        return sse_response(run.events(), run.generation, done=False)
    try:
        await until_disconnect(http, run.drain())
    finally:
        run.generation.abort()
    results = [run.select(run.result(choice, choice.text)) for choice in run.generation.choices]
    return results if several or len(results) > 1 else results[0]


def prompt_tokens(tokenizer, prompt: LlamaPrompt) -> list[int]:
    """A prompt's ids. In a mixed list, only a string that comes first gets the BOS (as
    llama-server: the tokenizer's special tokens are added to a leading string)."""
    if isinstance(prompt, str):
        return encode(tokenizer, prompt)
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, int):
            ids.append(part)
        else:
            ids += tokenizer(part, add_special_tokens=i == 0)["input_ids"]
    return ids


@dataclass
class _Clock:
    """When each choice began, got its first token and finished (time.perf_counter)."""

    start: float = field(default_factory=time.perf_counter)
    first: dict[int, float] = field(default_factory=dict)
    end: dict[int, float] = field(default_factory=dict)

    def see(self, choice: Choice, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            self.first.setdefault(choice.index, now)
        if out.finished:
            self.end[choice.index] = now

    def timings(self, choice: Choice) -> dict:
        """llama-server's `timings`, measured at the server: prompt_ms runs from the request to
        the first token (queueing included), predicted_ms from there to the last token."""
        now = time.perf_counter()
        first = self.first.get(choice.index, now)
        prompt_ms = (first - self.start) * 1000
        predicted_ms = (self.end.get(choice.index, now) - first) * 1000
        return {
            "prompt_n": choice.prompt_tokens,
            "prompt_ms": prompt_ms,
            **_rates("prompt", choice.prompt_tokens, prompt_ms),
            "predicted_n": choice.generated_tokens,
            "predicted_ms": predicted_ms,
            **_rates("predicted", choice.generated_tokens, predicted_ms),
        }


def _rates(name: str, n: int, ms: float) -> dict:
    return {
        f"{name}_per_token_ms": ms / n if n else 0.0,
        f"{name}_per_second": n * 1000 / ms if ms > 0 else 0.0,
    }


class _Run:
    """One /completion request: its generation, clock and the result bodies."""

    def __init__(
        self, state: ServerState, body: LlamaCompletionRequest, params, generation: Generation
    ):
        self.state, self.body, self.params, self.generation = state, body, params, generation
        self.n_ctx = generation.engine.intake.ctx_size
        self.clock = _Clock()

    async def drain(self) -> None:
        async for choice, out in self.generation.outputs():
            self.clock.see(choice, out)

    async def events(self) -> AsyncIterator[str]:
        """A `stop: false` event per output, then the choice's full result with `stop: true`."""
        async for choice, out in self.generation.outputs():
            self.clock.see(choice, out)
            if out.finished:
                event = self.result(choice, out.new_text, out.new_token_ids, out.new_logprobs)
            else:
                event = self.partial(choice, out)
            yield f"data: {json.dumps(event)}\n\n"

    def partial(self, choice: Choice, out: RequestOutput) -> dict:
        event = {
            "index": choice.index,
            "content": out.new_text,
            "tokens": out.new_token_ids,
            "stop": False,
        }
        if self.body.n_probs:
            event["completion_probabilities"] = self.probabilities(
                out.new_token_ids, out.new_logprobs
            )
        if self.body.timings_per_token:
            event["timings"] = self.clock.timings(choice)
        return event

    def result(self, choice: Choice, content: str, token_ids=None, logprobs=None) -> dict:
        """The final body of a choice: `content` and the token lists are the whole answer when
        not streaming, the last delta when streaming."""
        body, state = self.body, self.state
        token_ids = choice.token_ids if token_ids is None else token_ids
        stop_type, word = self.stop_type(choice)
        result = {
            "index": choice.index,
            "content": content,
            "tokens": token_ids if body.return_tokens or body.stream else [],
            "stop": True,
            "model": state.config.model_name,
            "tokens_predicted": choice.generated_tokens,
            "tokens_evaluated": choice.prompt_tokens,
            "generation_settings": body.settings(self.params, self.n_ctx, state.config.model_name),
            "prompt": state.tokenizer.decode(self.generation.requests[choice.index].prompt),
            "has_new_line": "\n" in choice.text,
            "truncated": False,
            "stop_type": stop_type,
            "stopping_word": word,
            "timings": self.clock.timings(choice),
        }
        if body.n_probs:
            entries = choice.logprobs if logprobs is None else logprobs
            result["completion_probabilities"] = self.probabilities(token_ids, entries)
        return result

    def stop_type(self, choice: Choice) -> tuple[str, str]:
        """("eos" | "word" | "limit", the stop string that ended it or "")."""
        if choice.finish_reason == "stop" and self.body.stop:
            skip = self.params.skip_special_tokens
            rest = self.state.tokenizer.decode(choice.token_ids, skip_special_tokens=skip)
            rest = rest[len(choice.text) :]
            for word in self.body.stop:
                if rest.startswith(word):
                    return "word", word
        return STOP_TYPES.get(choice.finish_reason, choice.finish_reason), ""

    def probabilities(self, token_ids: list[int], entries: list[dict[int, float]]) -> list[dict]:
        """`completion_probabilities`: each generated token with its log-prob and the n_probs
        likeliest tokens at that step (of the model's raw distribution)."""
        return [
            {
                **self.token_entry(token, entry[token]),
                "top_logprobs": [
                    self.token_entry(t, lp)
                    for t, lp in sorted(entry.items(), key=lambda item: -item[1])[
                        : self.body.n_probs
                    ]
                ],
            }
            for token, entry in zip(token_ids, entries, strict=True)
        ]

    def token_entry(self, token: int, logprob: float) -> dict:
        text = self.state.token_text(token)
        return {"id": token, "token": text, "bytes": list(text.encode()), "logprob": logprob}

    def select(self, result: dict) -> dict:
        """`response_fields`: only these, a nested one (`generation_settings/n_predict`) moved
        to the top under its path, as llama-server does."""
        if self.body.response_fields is None:
            return result
        selected = {}
        for path in self.body.response_fields:
            value, found = result, True
            for key in path.split("/"):
                found = found and isinstance(value, dict) and key in value
                value = value[key] if found else None
            if found:
                selected[path] = value
        return selected


# -- tokens and templates -------------------------------------------------------------------------


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, http: Request) -> dict:
    """Token ids, or {id, piece} objects with `with_pieces` (a piece that is not whole UTF-8
    is its list of bytes)."""
    state = server_state(http)
    state.ready_engine()
    tokenizer = state.tokenizer
    ids = tokenizer(
        body.content,
        add_special_tokens=body.add_special,
        split_special_tokens=not body.parse_special,
    )["input_ids"]
    if not body.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": token, "piece": token_piece(tokenizer, token)} for token in ids]}


def token_piece(tokenizer, token: int) -> str | list[int]:
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    name = tokenizer.convert_ids_to_tokens(token)
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", name)  # sentencepiece's byte fallback
    if byte:
        return [int(byte.group(1), 16)]
    decoder = _byte_decoder()  # byte-level BPE: each character stands for one byte
    if all(ch in decoder for ch in name):
        return [decoder[ch] for ch in name]
    return list(text.encode())


@cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: byte for byte, ch in bytes_to_unicode().items()}


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, http: Request) -> dict:
    state = server_state(http)
    state.ready_engine()
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
    return {"content": state.tokenizer.decode(body.tokens)}


@router.post("/apply-template", responses=ERROR_RESPONSES)
async def apply_template(body: ApplyTemplateRequest, http: Request) -> dict:
    """The chat template's text for these messages, generation prompt included, as
    /v1/chat/completions would run it (no inference)."""
    state = server_state(http)
    state.ready_engine()
    for i, message in enumerate(body.messages):
        message.check_supported(f"messages[{i}].")
        images = isinstance(message.content, list) and any(
            isinstance(part, ImagePart) for part in message.content
        )
        if images and state.processor is None:
            raise InvalidRequestError("this model does not take images", param="messages")
    tokenizer = state.tokenizer
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template", param="messages")
    tools = tool_use(body, state.tool_parser)
    messages = [m.as_template_dict(f"messages[{i}].") for i, m in enumerate(body.messages)]
    check_tool_messages(body.messages)
    messages, kwargs = template_messages(tokenizer, as_tool_turns(messages), tools)
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as error:  # the template's own checks (role order, ...) raise jinja errors
        raise InvalidRequestError(
            f"the chat template rejected the messages: {error}", param="messages"
        ) from None
    return {"prompt": prompt}


# -- GET /props, /slots ---------------------------------------------------------------------------


@router.get("/props", responses=ERROR_RESPONSES)
async def props(http: Request) -> dict:
    """The server's properties: default generation settings, slots, model and template."""
    state = server_state(http)
    engine = state.ready_engine()
    config, tokenizer = engine.intake.config, state.tokenizer
    return {
        "default_generation_settings": _slot(state, 0, busy=False),
        "total_slots": config.scheduler.max_num_seqs,
        "model_path": str(config.model.model),
        "model_alias": state.config.model_name,
        "chat_template": tokenizer.chat_template or "",
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
        "modalities": {"vision": state.processor is not None, "audio": False},
        "build_info": f"kestrel {kestrel.__version__}",
        "is_sleeping": False,
    }


@router.get("/slots", responses=ERROR_RESPONSES)
async def slots(http: Request, fail_on_no_slot: int = 0):
    """One entry per running-sequence slot (-np); the first `running` are busy. Off without
    --slots (501), as llama-server; `?fail_on_no_slot=1` answers 503 when all are busy."""
    state = server_state(http)
    if not state.config.slots:
        return JSONResponse({"error": SLOTS_OFF}, status_code=501)
    engine = state.ready_engine()
    total = engine.intake.config.scheduler.max_num_seqs
    running = min(state.stats.load.running, total)
    if fail_on_no_slot and running >= total:
        return JSONResponse({"error": NO_SLOT}, status_code=503)
    return [_slot(state, i, busy=i < running) for i in range(total)]


def _slot(state: ServerState, index: int, busy: bool) -> dict:
    """A slot as llama-server describes one; its params are /completion's defaults."""
    defaults = LlamaCompletionRequest(prompt="")
    params: SamplingParams = defaults.sampling_params(
        state.config.default_max_tokens, state.tokenizer
    )
    n_ctx = state.engine.intake.ctx_size
    return {
        "id": index,
        "id_task": -1,
        "n_ctx": n_ctx,
        "speculative": False,
        "is_processing": busy,
        "params": defaults.settings(params, n_ctx, state.config.model_name),
    }
