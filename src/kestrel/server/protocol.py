"""OpenAI (and llama-server) request and response bodies as pydantic models.

Requests are strict (a string is not a number) and ignore unknown fields, as OpenAI's SDKs send
newer fields first. Types are checked here; value ranges are checked once, by SamplingParams, whose
InvalidRequestError names the parameter.
"""

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    pass


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by chat and completions (vLLM's extras included: top_k, min_p, ...)."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    max_kv_size: int | None = Field(None, description="a per-request KV bound, below the server's")

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=_or(self._max_tokens(), default_max_tokens),
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self._logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def check_kv_size(self) -> int | None:
        if self.max_kv_size is not None and self.max_kv_size < 1:
            raise InvalidRequestError("max_kv_size must be at least 1", param="max_kv_size")
        return self.max_kv_size

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str  # data:image/...;base64,... or file:// under --allowed-local-media-path
    detail: str | None = None  # accepted and ignored


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        """The message as chat templates expect it: text content, `developer` as `system`;
        content with images stays a list of OpenAI parts (kestrel.media reads them)."""
        content = self.content
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


MAX_MESSAGES = 2048  # more is a 400 (the body size limit bounds the rest)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise InvalidRequestError(
                    "max_completion_tokens must be at least 1", param="max_completion_tokens"
                )
            return self.max_completion_tokens
        return super()._max_tokens()

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs must be in [0, 20]", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts, each a string or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return list(prompt)

    def _logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        # OpenAI's completions default is 16 tokens, unless the server sets one (-n)
        return super().sampling_params(default_max_tokens or 16)


class LlamaCompletionRequest(_Request):
    """llama-server's native /completion body (the fields we share)."""

    prompt: str | list[int]
    n_predict: int = -1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False
    n_probs: int = 0

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.n_predict if self.n_predict > 0 else default_max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=None if self.seed < 0 else self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            logprobs=self.n_probs or None,
        )


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int]


def _or(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None


# -- responses --------------------------------------------------------------------------------


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kestrel"


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail
