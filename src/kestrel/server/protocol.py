"""OpenAI (and llama-server) request and response bodies as pydantic models.

Requests are strict (a string is not a number) and ignore unknown fields, as OpenAI's SDKs send
newer fields first. Named fields kestrel does not implement are another matter: the tables under
"not supported" list them with the reason, and a request that sets one to anything but its
default gets 400 naming it, never an answer that silently ignored it. Types are checked here; value
ranges are checked once, by SamplingParams, whose InvalidRequestError names the parameter.
"""

import re
import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kestrel import structured
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.tools.turns import arguments_object, template_call
from kestrel.structured import StructuredOutput

# -- not supported ----------------------------------------------------------------------------
# Named fields (OpenAI's, vLLM's and llama-server's) kestrel does not implement yet: field -> (its
# "off" values, why). Set to anything else, the request gets 400 naming the field; unknown fields
# in no table are ignored. docs/server.md's "Request fields" lists what is supported.

# chat and completions
SAMPLING_UNSUPPORTED = {
    "guided_decoding_backend": ((), "kestrel's one grammar backend is llguidance"),
    "guided_whitespace_pattern": ((), "JSON is compact (no whitespace between tokens)"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "min_tokens": ((0,), "min_tokens is not supported"),
    "prompt_logprobs": ((), "prompt log-probs are not supported"),
    "truncate_prompt_tokens": ((), "prompts are never truncated; a long one is a 400"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not supported"),
}

CHAT_UNSUPPORTED = {
    **SAMPLING_UNSUPPORTED,
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "verbosity": (("medium",), "verbosity is not supported"),
    "store": ((False,), "kestrel stores no completions"),
    "metadata": (({},), "metadata is kept with stored completions; kestrel stores none"),
    "service_tier": (("auto", "default"), "kestrel has one service tier"),
    "add_generation_prompt": ((True,), "the generation prompt is always added"),
    "continue_final_message": ((False,), "continuing the final message is not supported"),
    "echo": ((False,), "echo is not supported on chat completions"),
}

MESSAGE_UNSUPPORTED = {
    "audio": ((), "audio is not supported"),
}

COMPLETION_UNSUPPORTED = {
    **SAMPLING_UNSUPPORTED,
    "suffix": (("",), "no infill (fill-in-the-middle) support: a suffix would be ignored"),
}

# /v1/embeddings (vLLM's extras)
EMBEDDING_UNSUPPORTED = {
    "truncate_prompt_tokens": ((), "inputs are never truncated; a long one is a 400"),
    "normalize": ((True,), "embeddings are always L2-normalized"),
}

# llama-server's /completion. Knobs that act only when another is on (dry_base, xtc_threshold,
# mirostat_tau, dynatemp_exponent, ...) are not listed: their switch is.
LLAMA_UNSUPPORTED = {
    "dynatemp_range": ((0,), "dynamic temperature is not supported"),
    "typical_p": ((1,), "locally typical sampling is not supported"),
    "top_n_sigma": ((-1,), "top-n-sigma sampling is not supported"),
    "dry_multiplier": ((0,), "DRY sampling is not supported"),
    "xtc_probability": ((0,), "XTC sampling is not supported"),
    "mirostat": ((0,), "Mirostat sampling is not supported"),
    "min_keep": ((0,), "min_keep is not supported"),
    "samplers": (
        (),
        "kestrel's sampler order is fixed: penalties, temperature, top_k, top_p, min_p (vLLM's)",
    ),
    "n_keep": ((0,), "kestrel keeps --keep sink tokens when it trims (server-wide)"),
    "n_indent": ((0,), "n_indent is not supported"),
    "n_cache_reuse": ((0,), "KV shifting for cache reuse is not supported"),
    "t_max_predict_ms": ((0,), "prediction time limits are not supported"),
    "id_slot": ((-1,), "kestrel schedules requests itself: there are no slots to pick"),
    "post_sampling_probs": ((False,), "post-sampling probabilities are not supported"),
    "return_progress": ((False,), "prompt progress events are not supported"),
    "lora": (
        ([],),
        "per-request adapter scales are not supported: name a LoRA adapter as `model` on "
        "/v1/completions or /v1/chat/completions",
    ),
    "multimodal_data": ((), "multimodal prompts on /completion are not supported"),
}


def _is_off(value, off_values: tuple) -> bool:
    # 1 == True in Python; a bool must match a bool
    return any(
        value == off and isinstance(value, bool) == isinstance(off, bool) for off in off_values
    )


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _CheckedRequest(_Request):
    """A body whose named-but-unsupported fields (`UNSUPPORTED`) are rejected unless off."""

    model_config = ConfigDict(strict=True, extra="allow")  # kept aside, in model_extra
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}

    def check_supported(self, prefix: str = "") -> None:
        """400 naming the first field set to a value kestrel would otherwise ignore."""
        for name, value in (self.model_extra or {}).items():
            rule = self.UNSUPPORTED.get(name)
            if rule is not None and value is not None and not _is_off(value, rule[0]):
                raise InvalidRequestError(f"{prefix}{name}: {rule[1]}", param=prefix + name)


class _Response(BaseModel):
    pass


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(_CheckedRequest):
    UNSUPPORTED = {"include_obfuscation": ((False,), "kestrel sends no obfuscation padding")}

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # pydantic's BaseModel has a `schema` method
    strict: bool | None = None  # kestrel enforces every schema it is given


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self, param: str = "response_format") -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput("json_object", param=param)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError(
                    f"{param}.json_schema is required with type json_schema",
                    param=f"{param}.json_schema",
                )
            return structured.json_schema(self.json_schema.json_schema, f"{param}.json_schema")
        return None


class StructuredOutputs(_CheckedRequest):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object)."""

    UNSUPPORTED = {
        "structural_tag": ((), "structural tags are not supported"),
        "whitespace_pattern": ((), "JSON is compact (no whitespace between tokens)"),
        "disable_any_whitespace": ((True,), "JSON is compact (no whitespace between tokens)"),
        "disable_fallback": ((), "kestrel's one grammar backend is llguidance"),
        "disable_additional_properties": ((), "additionalProperties follows the schema"),
    }
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraints(self, p: str) -> list[StructuredOutput]:
        self.check_supported(p)
        return _constraints(
            json_schema=(self.json_, f"{p}json"),
            regex=(self.regex, f"{p}regex"),
            choice=(self.choice, f"{p}choice"),
            grammar=(self.grammar, f"{p}grammar"),
            json_object=(self.json_object or None, f"{p}json_object"),
        )


def _constraints(**given: tuple) -> list[StructuredOutput]:
    """The constraints set among `given` (kind -> (value or None, request field))."""
    makers = {
        "json_schema": structured.json_schema,
        "choice": structured.choice,
        "json_object": lambda _, param: StructuredOutput("json_object", param=param),
    }
    found = []
    for kind, (value, param) in given.items():
        if value is not None:
            make = makers.get(kind, lambda v, p, k=kind: StructuredOutput(k, v, p))
            found.append(make(value, param))
    return found


def one_structured_output(found: list[StructuredOutput]) -> StructuredOutput | None:
    """The request's one constraint, compiled once to reject a bad one with 400 here."""
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidRequestError(
            f"set one structured output, not several ({names})", param=found[1].param
        )
    if found:
        found[0].check()
    return found[0] if found else None


class _SamplingRequest(_CheckedRequest):
    """Fields shared by chat and completions (vLLM's extras included: top_k, min_p, ...)."""

    UNSUPPORTED = SAMPLING_UNSUPPORTED
    model: str | None = None  # omitted: the served model (as llama-server and vLLM)
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
    user: str | None = None  # informational (OpenAI's end-user id); kestrel keeps no record
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    max_kv_size: int | None = Field(None, description="a per-request KV bound, below the server's")
    cache_prompt: bool = True  # llama-server's: False recomputes the prompt (same output)
    priority: int = 0  # vLLM's: lower runs sooner under --scheduling-policy priority
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def sampling_params(
        self, default_max_tokens: int | None, extra: list[StructuredOutput] = ()
    ) -> SamplingParams:
        """The request's SamplingParams; `extra`: constraints the route adds (tool calls)."""
        self.check_supported()
        if self.stream_options is not None:
            self.stream_options.check_supported("stream_options.")
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
            structured_output=one_structured_output([*self.constraints(), *extra]),
            cache_prompt=self.cache_prompt,
        )

    def constraints(self) -> list[StructuredOutput]:
        found = _constraints(
            json_schema=(self.guided_json, "guided_json"),
            regex=(self.guided_regex, "guided_regex"),
            choice=(self.guided_choice, "guided_choice"),
            grammar=(self.guided_grammar, "guided_grammar"),
        )
        if self.response_format is not None:
            found += filter(None, [self.response_format.structured_output()])
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints("structured_outputs.")
        return found

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
    detail: str | None = None  # only "auto": see ChatMessage.check_supported


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]

FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"  # OpenAI's (and a dot, as vLLM allows)


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text of an object; ChatMessage.as_template_dict parses it


class ToolCallParam(_Request):
    """An earlier assistant turn's call, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; omitted: no arguments
    strict: bool | None = None  # kestrel enforces the schema whenever it forces a call


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_CheckedRequest):
    UNSUPPORTED = MESSAGE_UNSUPPORTED

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # given to the chat template; a `function` turn's function
    tool_calls: list[ToolCallParam] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    function_call: FunctionCallParam | None = None  # the deprecated form of one tool call

    def check_supported(self, prefix: str = "") -> None:
        super().check_supported(prefix)
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            if isinstance(part, ImagePart) and part.image_url.detail not in (None, "auto"):
                param = f"{prefix}content[{j}].image_url.detail"
                raise InvalidRequestError(
                    f"{param}: only 'auto': the model's own processor sizes images", param=param
                )

    def as_template_dict(self, prefix: str = "") -> dict:
        """The message as chat templates expect it: text content, `developer` as `system`;
        content with images stays a list of OpenAI parts (kestrel.media reads them); tool calls
        with their arguments parsed (`prefix`: the message's name in errors)."""
        content = self.content
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                _template_call(c, prefix, j) for j, c in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.function_call is not None:  # kestrel.server.tools.legacy makes it a tool call
            param = f"{prefix}function_call.arguments"
            arguments = arguments_object(self.function_call.arguments, param)
            message["function_call"] = {"name": self.function_call.name, "arguments": arguments}
        return message


def _template_call(call: ToolCallParam, prefix: str, j: int) -> dict:
    """A call as transformers' chat templates take it: `arguments` a dict, not JSON text."""
    arguments = arguments_object(
        call.function.arguments, f"{prefix}tool_calls[{j}].function.arguments"
    )
    return template_call(call.id, call.function.name, arguments)


MAX_MESSAGES = 2048  # more is a 400 (the body size limit bounds the rest)


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated form of tools (kestrel.server.tools.legacy)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # to the chat template, for templates that read them (kestrel.server.reasoning)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None

    def template_kwargs(self) -> dict[str, tuple]:
        """The chat template's extra arguments: name -> (value, the request field to name)."""
        kwargs = {
            name: (value, f"chat_template_kwargs.{name}")
            for name, value in (self.chat_template_kwargs or {}).items()
        }
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = (self.reasoning_effort, "reasoning_effort")
        return kwargs

    def check_supported(self, prefix: str = "") -> None:
        super().check_supported(prefix)
        for i, message in enumerate(self.messages):
            message.check_supported(f"messages[{i}].")

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
    UNSUPPORTED = COMPLETION_UNSUPPORTED

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # only n (or 1 with n = 1): every generated choice is returned

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
        if self.best_of not in (None, self.n):
            raise InvalidRequestError(
                f"best_of must equal n ({self.n}): kestrel returns every choice it generates "
                "rather than ranking more candidates than it returns",
                param="best_of",
            )
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError(
                "echo with logprobs asks for the prompt's log-probs, which are not supported",
                param="echo",
            )
        # OpenAI's completions default is 16 tokens, unless the server sets one (-n)
        return super().sampling_params(default_max_tokens or 16)


class EmbeddingRequest(_CheckedRequest):
    """OpenAI's embeddings body; `dimensions` must be the model's hidden size (no truncation)."""

    UNSUPPORTED = EMBEDDING_UNSUPPORTED
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None  # omitted: the served model (as the other routes)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # informational (OpenAI's end-user id); kestrel keeps no record
    priority: int = 0  # vLLM's: lower runs sooner under --scheduling-policy priority

    def inputs(self) -> list[str | list[int]]:
        """One or several inputs, each text or token ids; 400 naming an empty one."""
        self.check_supported()
        one = isinstance(self.input, str) or (self.input and isinstance(self.input[0], int))
        inputs = [self.input] if one else list(self.input)
        if not inputs:
            raise InvalidRequestError("input is empty", param="input")
        for i, item in enumerate(inputs):
            if not item:
                param = "input" if one else f"input[{i}]"
                raise InvalidRequestError(f"{param} is empty", param=param)
        return inputs


LlamaPrompt = str | list[int | str]  # text, token ids, or both mixed


class LlamaCompletionRequest(_CheckedRequest):
    """llama-server's native /completion body. Defaults are llama-server's, except
    repeat_last_n: kestrel's penalties see the whole context (-1), or none (0)."""

    UNSUPPORTED = LLAMA_UNSUPPORTED

    prompt: str | list[int | str | list[int | str]]
    n_predict: int = -1
    n_cmpl: int = 1
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    stop: list[str] = Field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False
    n_probs: int = 0
    logit_bias: list[list[int | str | float | bool]] | dict[str, float | bool] | None = None
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: list[str] | None = None
    cache_prompt: bool = True  # False: recompute the prompt (reusing a prefix changes no output)
    grammar: str = ""  # GBNF
    json_schema: dict | None = None

    def prompts(self) -> tuple[list[LlamaPrompt], bool]:
        """(the prompts, whether several were given: then the answer is a list). A list with a
        token id in it is one mixed prompt; a list of strings and lists is several prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt], False
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(isinstance(part, int) for part in prompt):
            if any(isinstance(part, list) for part in prompt):
                raise InvalidRequestError(
                    "a prompt mixes token ids and strings; lists of prompts hold prompts",
                    param="prompt",
                )
            return [prompt], False
        return list(prompt), True

    def sampling_params(self, default_max_tokens: int | None, tokenizer) -> SamplingParams:
        self.check_supported()
        repeat, presence, frequency = self._penalties()
        try:
            return SamplingParams(
                n=self.n_cmpl,
                max_tokens=self._max_tokens(default_max_tokens),
                temperature=max(self.temperature, 0.0),  # below 0: greedy, as llama-server
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                repetition_penalty=repeat,
                presence_penalty=presence,
                frequency_penalty=frequency,
                logit_bias=llama_logit_bias(self.logit_bias, tokenizer),
                seed=None if self.seed == -1 else self.seed,
                stop=self.stop,
                ignore_eos=self.ignore_eos,
                logprobs=self.n_probs or None,
                cache_prompt=self.cache_prompt,
                structured_output=one_structured_output(
                    _constraints(
                        grammar=(self.grammar or None, "grammar"),
                        json_schema=(self.json_schema, "json_schema"),
                    )
                ),
            )
        except InvalidRequestError as error:  # name the field as this body spells it
            name = LLAMA_NAMES.get(error.param, error.param)
            raise InvalidRequestError(str(error).replace(error.param, name, 1), name) from None

    def _max_tokens(self, default: int | None) -> int | None:
        if self.n_predict == -1:
            return default
        if self.n_predict < 1:
            raise InvalidRequestError(
                "n_predict must be -1 (until the context is full) or at least 1",
                param="n_predict",
            )
        return self.n_predict

    def _penalties(self) -> tuple[float, float, float]:
        """(repeat, presence, frequency). repeat_last_n 0 turns them off, as in llama-server;
        a window other than the whole context (-1) is not something kestrel can honour."""
        if self.repeat_last_n == 0:
            return 1.0, 0.0, 0.0
        penalties = (self.repeat_penalty, self.presence_penalty, self.frequency_penalty)
        if penalties != (1.0, 0.0, 0.0) and self.repeat_last_n != -1:
            raise InvalidRequestError(
                "repeat_last_n: kestrel's penalties see the whole context: use -1, or 0 for none",
                param="repeat_last_n",
            )
        return penalties

    def settings(self, params: SamplingParams, n_ctx: int, model: str) -> dict:
        """llama-server's `generation_settings`: the options as the request runs them."""
        return {
            "n_ctx": n_ctx,
            "model": model,
            **generation_settings(params),
            "stream": self.stream,
            "repeat_last_n": -1 if params.repetition_penalty != 1 else self.repeat_last_n,
            "n_probs": self.n_probs,
            "logit_bias": [[token, bias] for token, bias in (params.logit_bias or {}).items()],
        }


# kestrel's SamplingParams names -> /completion's
LLAMA_NAMES = {
    "n": "n_cmpl",
    "max_tokens": "n_predict",
    "repetition_penalty": "repeat_penalty",
    "logprobs": "n_probs",
}

LOGIT_BAN = -100.0  # `false` bans a token: OpenAI's ban value, the bottom of the allowed range


def llama_logit_bias(bias, tokenizer) -> dict[int, float] | None:
    """llama-server's logit_bias: [[token, bias], ...] or {"token": bias}; a token is an id or a
    string (each of its tokens is biased); a bias of `false` bans the token."""
    if not bias:
        return None
    pairs = bias.items() if isinstance(bias, dict) else bias
    result: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2 or not _is_bias(pair[1]):
            raise InvalidRequestError(
                "logit_bias entries are [token id or string, a number in [-100, 100] or false]",
                param="logit_bias",
            )
        key, value = pair
        value = LOGIT_BAN if value is False else float(value)
        for token in _bias_tokens(key, tokenizer):
            result[token] = value
    return result


def _is_bias(value) -> bool:
    if value is False:
        return True
    return isinstance(value, int | float) and value is not True and -100 <= value <= 100


def _bias_tokens(key, tokenizer) -> list[int]:
    if isinstance(key, int):
        return [key]
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):  # OpenAI's form: {"15043": 1}
        return [int(key)]
    if isinstance(key, str):
        return tokenizer.encode(key, add_special_tokens=False)
    raise InvalidRequestError("logit_bias keys are token ids or strings", param="logit_bias")


def generation_settings(params: SamplingParams) -> dict:
    """The sampling options in llama-server's names (/props and /completion report them)."""
    return {
        "n_predict": params.max_tokens or -1,
        "max_tokens": params.max_tokens or -1,
        "seed": -1 if params.seed is None else params.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
        "samplers": ["penalties", "temperature", "top_k", "top_p", "min_p"],
    }


class TokenizeRequest(_Request):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int]


class ApplyTemplateRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


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


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(_Response):
    """Speculative decoding's proposed tokens (OpenAI's predicted-output fields), and the
    thinking's tokens (with a reasoning parser)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # when speculating, or with a reasoning parser
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking (kestrel.server.reasoning)
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None  # answers to the deprecated `functions`


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


class DeltaFunction(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A piece of a streamed call: its first names it (id, name), the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None  # answers to the deprecated `functions`


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


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 values
    index: int


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kestrel"
    aliases: list[str] = Field(default_factory=list)  # other names `model` may use (llama-server)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    root: str | None = None  # a LoRA adapter's folder (vLLM's)


class LoadLoRARequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str


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
