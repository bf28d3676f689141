"""SamplingParams (vLLM's shape) and the sampling functions.

Order, as in vLLM: the structured-output mask (the runner's, kestrel.engine.grammar), logit bias,
repetition/presence/frequency penalties, temperature, top-k, top-p, min-p, then a draw from a per-request generator (seeded => reproducible). Log-probs are those of the
model's raw distribution, before any of these transformations.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from kestrel.errors import InvalidRequestError
from kestrel.structured import StructuredOutput

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string


@dataclass
class SamplingParams:
    """How to sample one request, with vLLM's names and defaults. Values out of range raise
    InvalidRequestError naming the parameter.

    Attributes:
        n: completions per prompt.
        max_tokens: most tokens to generate (None: until the context is full).
        temperature: 0 (or below 1e-5) samples greedily.
        top_p: nucleus sampling's probability mass (1: off).
        top_k: keep the k likeliest tokens (0: off).
        min_p: drop tokens below this fraction of the likeliest one's probability (0: off).
        repetition_penalty: divides the positive logits (multiplies the negative ones) of tokens
            seen in the prompt or output (1: off).
        presence_penalty: subtracted once from the logits of tokens already generated.
        frequency_penalty: subtracted per occurrence from the logits of tokens already generated.
        logit_bias: token id -> a bias added to its logit (-100 bans it).
        seed: makes sampling reproducible for this request.
        stop: strings that end the output (left out of it unless include_stop_str_in_output).
        stop_token_ids: token ids that end the output, beside the model's end-of-sequence ids.
        ignore_eos: keep generating past end-of-sequence tokens.
        logprobs: also return the log-probs of the sampled token and the k likeliest, from the
            model's raw distribution.
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the stop string that ended the output in its text.
        structured_output: a constraint every token must follow (kestrel.structured).
        cache_prompt: False recomputes the prompt instead of reusing cached prefix KV.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None  # the grammar every token must follow
    cache_prompt: bool = True  # may reuse cached prefix KV (llama-server's opt-out: False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        for check, param, message in self._checks():
            if not check:
                raise InvalidRequestError(f"{param} {message}", param=param)

    def _checks(self):
        finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
        yield (
            (isinstance(self.n, int) and 1 <= self.n <= 128),
            "n",
            "must be an integer in [1, 128]",
        )
        yield (
            (
                self.max_tokens is None
                or (isinstance(self.max_tokens, int) and 1 <= self.max_tokens < 2**31)
            ),
            "max_tokens",
            "must be in [1, 2^31)",
        )
        yield (
            finite(self.temperature) and 0 <= self.temperature <= 100,
            "temperature",
            "must be in [0, 100]",
        )
        yield finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"
        yield (
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            "must be -1, 0 (off) or positive",
        )
        yield finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"
        yield (
            finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
            "repetition_penalty",
            "must be in (0, 10]",
        )
        yield (
            finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        yield (
            finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        yield (
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "must be an integer in [0, 2^63)",
        )
        yield (
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        yield (
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"allows at most {MAX_STOP_STRINGS} strings",
        )
        yield all(isinstance(s, str) and s for s in self.stop), "stop", "strings must be non-empty"
        yield (
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"strings must be at most {MAX_STOP_CHARS} characters",
        )
        yield (
            all(finite(v) and -100 <= v <= 100 for v in (self.logit_bias or {}).values()),
            "logit_bias",
            "values must be in [-100, 100]",
        )

    @property
    def greedy(self) -> bool:
        # as vLLM: a temperature this small would overflow logits / temperature to inf
        return self.temperature < GREEDY_BELOW

    def for_choice(self, index: int) -> "SamplingParams":
        """The params of the `index`-th of n choices: one sequence each, distinct seeds."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return replace(self, n=1, seed=seed)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias keys and stop ids must be tokens of this model."""
    for token in list(params.logit_bias or {}) + list(params.stop_token_ids):
        if not (isinstance(token, int) and 0 <= token < vocab_size):
            raise InvalidRequestError(
                f"token id {token!r} is not in [0, {vocab_size})", param="logit_bias"
            )


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids, output_ids
) -> torch.Tensor:
    """(V,) raw logits -> (V,) logits to sample from (float32)."""
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        values = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / p, values * p)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(
            torch.tensor(output_ids, device=logits.device), minlength=logits.shape[0]
        )
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. (V,) -> (V,)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        top = torch.topk(logits, params.top_k)
        if int((logits >= top.values[-1]).sum()) == params.top_k:  # no tie with the k-th
            # top-p and min-p over the k survivors only: the same masks as over the whole
            # vocabulary without sorting it (llama-server's defaults use all three)
            masked = torch.full_like(logits, float("-inf"))
            return masked.scatter(0, top.indices, _top_p_min_p(top.values, params))
        logits = logits.masked_fill(logits < top.values[-1], float("-inf"))
    return _top_p_min_p(logits, params)


def _top_p_min_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(N,) tempered logits -> (N,) with the top-p and min-p tails at -inf."""
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the token crossing p
        drop[0] = False  # the likeliest token stays even when p is below float32's precision
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator, prompt_ids, output_ids) -> int:
    """Draw the next token from (V,) raw logits."""
    processed = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return int(processed.argmax())
    probs = truncate(processed, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """{token id: log-prob} for the sampled token and the k most likely ones, from raw logits."""
    logprobs = logits.float().log_softmax(-1)
    result = {token: float(logprobs[token])}
    if k:
        values, ids = logprobs.topk(k)
        result.update(zip(ids.tolist(), values.tolist(), strict=True))
    return result


def verify_draft(
    logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    generator,
    prompt_ids,
    output_ids,
) -> list[int]:
    """Speculative decoding's verification: (k+1, V) raw logits of the rows that fed the pending
    token and the k `draft` tokens -> the accepted draft tokens and one more (a correction, or
    the bonus token after all k). Each row is processed as a plain step would be, its output so
    far being the tokens accepted before it (penalties see them). Greedy: a draft token is
    accepted when it is the argmax, so the tokens are exactly the plain ones. Sampled: the
    draft is deterministic, so token d is accepted with the target's probability p(d), and on
    rejection the token is drawn from p with d removed, renormalised; each token then follows
    p exactly (standard rejection sampling with a one-hot proposal)."""
    tokens: list[int] = []
    for i, row in enumerate(logits):
        processed = process_logits(row, params, prompt_ids, output_ids + tokens)
        if params.greedy:
            token = int(processed.argmax())
            tokens.append(token)
            if i == len(draft) or token != draft[i]:
                return tokens
            continue
        probs = truncate(processed, params).softmax(-1)
        if i == len(draft):  # every draft token accepted: the bonus token
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
            return tokens
        d = draft[i]
        u = torch.rand((), generator=generator, device=probs.device)
        if u < probs[d]:
            tokens.append(d)
            continue
        residual = probs.clone()
        residual[d] = 0.0
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return tokens
    return tokens
