"""SamplingParams (vLLM's shape) and the one sampler: every path (the offline LLM, the server, both
runners, speculative verification and drafts) samples a batch of rows with these functions.

Order, as in vLLM: the structured-output mask (the runner's, kestrel.engine.grammar), logit bias,
repetition/presence/frequency penalties, temperature (`process_rows`), top-k, top-p, min-p
(`truncate_rows`), then a draw (`sample_rows`): an exponential race on the device, a seeded
request's noise from its own generator so that its seed gives the same tokens whatever batch it
is in. Top-k keeps every token tied with the k-th largest logit (vLLM's threshold; llama.cpp
keeps exactly k), top-p every token tied with the one that crosses p. `verify_rows` is speculative decoding's acceptance over the same steps.
Log-probs (`logprob_rows`) are those of the model's raw distribution, before any of them.
"""

import math
from collections import Counter
from collections.abc import Sequence
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


# -- the sampler: one batch of rows at a time, on the logits' device ------------------------------


@dataclass(frozen=True)
class Row:
    """One row of a batch to sample: its request's params, the generator of a seeded request
    (None: the device's default one) and the tokens its penalties see."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()

    @property
    def penalised(self) -> bool:
        """Whether a logit bias or a penalty changes this row's logits."""
        p = self.params
        return bool(p.logit_bias) or p.repetition_penalty != 1.0 or self.counts_output

    @property
    def counts_output(self) -> bool:
        """Whether the presence or frequency penalty reads the output's tokens."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A seeded request's generator: its draws then depend on its seed alone."""
    return torch.Generator(device=device).manual_seed(seed)


def process_rows(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """(B, V) raw logits -> (B, V) float32 logits to draw from: logit bias, the repetition
    penalty, the presence and frequency penalties, then temperature (1 for greedy rows, so their
    argmax is the processed logits'). `logits` itself when no row changes them."""
    sampled = not all(row.params.greedy for row in rows)
    if not sampled and not any(row.penalised for row in rows):
        return logits
    x = logits.to(torch.float32, copy=True)
    _add_logit_bias(x, rows)
    _apply_repetition_penalty(x, rows)
    _apply_presence_frequency(x, rows)
    if sampled:
        temperature = [1.0 if row.params.greedy else row.params.temperature for row in rows]
        x /= torch.tensor(temperature, device=x.device)[:, None]
    return x


def _scatter_index(x: torch.Tensor, rows: list[int], tokens: list[int]) -> tuple:
    """(rows, tokens) host columns -> the (row, token) index into x, on its device in one copy."""
    index = torch.tensor([rows, tokens], dtype=torch.long).to(x.device)
    return index[0], index[1]


def _column(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(x.device)


def _add_logit_bias(x: torch.Tensor, rows: list[Row]) -> None:
    at, tokens, bias = [], [], []
    for i, row in enumerate(rows):
        for token, value in (row.params.logit_bias or {}).items():
            at.append(i)
            tokens.append(token)
            bias.append(value)
    if at:
        x[_scatter_index(x, at, tokens)] += _column(x, bias)


def _apply_repetition_penalty(x: torch.Tensor, rows: list[Row]) -> None:
    """Divides the positive logits, multiplies the negative ones, of tokens in prompt or output."""
    at, tokens = [], []
    for i, row in enumerate(rows):
        if row.params.repetition_penalty != 1.0:
            seen = set(row.prompt_ids).union(row.output_ids)
            at += [i] * len(seen)
            tokens += seen
    if at:
        index = _scatter_index(x, at, tokens)
        penalty = _column(x, [row.params.repetition_penalty for row in rows])[index[0]]
        logits = x[index]
        x[index] = torch.where(logits > 0, logits / penalty, logits * penalty)


def _apply_presence_frequency(x: torch.Tensor, rows: list[Row]) -> None:
    """Subtracts presence once and frequency per occurrence, for tokens of the output only."""
    at, tokens, counts = [], [], []
    for i, row in enumerate(rows):
        if row.counts_output:
            seen = Counter(row.output_ids)
            at += [i] * len(seen)
            tokens += seen.keys()
            counts += seen.values()
    if at:
        index = _scatter_index(x, at, tokens)
        frequency = _column(x, [row.params.frequency_penalty for row in rows])[index[0]]
        presence = _column(x, [row.params.presence_penalty for row in rows])[index[0]]
        x[index] -= frequency * _column(x, counts) + presence


def truncate_rows(x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """(B, V) tempered logits -> (B, V) with the top-k, top-p and min-p tails at -inf, in that
    order, each a floor on the logits. The tie rule is vLLM's: top-k keeps every token tied with
    the k-th largest logit (llama.cpp keeps exactly k, cutting the tie by its sort), and top-p
    every token tied with the one whose probability crosses p (kept, as the likeliest always is).
    Top-p sees only what top-k kept; min-p drops tokens below min_p times the likeliest one's
    probability. Rows with top-k read a top-k window of the logits; only top-p without top-k
    sorts a whole row."""
    vocab, params = x.shape[-1], [row.params for row in rows]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p < 1 for p in params]
    if not any(top_k) and not any(top_p) and not any(p.min_p for p in params):
        return x
    columns = [top_k, [p.top_p if p.top_p < 1 else 2.0 for p in params], [p.min_p for p in params]]
    k, p, min_p = torch.tensor(columns, device=x.device)[:, :, None]  # (B, 1) each
    full = any(uses_p and not uses_k for uses_k, uses_p in zip(top_k, top_p, strict=True))
    # (B, W) the largest logits in order: W = V, or the largest k (1: the max, for min-p)
    window = x.sort(-1, descending=True).values if full else x.topk(max(1, *top_k)).values
    floor = torch.where(k > 0, window.gather(-1, (k.long() - 1).clamp(min=0)), float("-inf"))
    if any(top_p):
        floor = torch.maximum(floor, _top_p_floor(x, window, floor, p))
    floor = torch.maximum(floor, window[:, :1] + min_p.log())  # log 0: -inf, no floor
    return x.masked_fill(x < floor, float("-inf"))


def _top_p_floor(x, window, floor, top_p) -> torch.Tensor:
    """(B, 1) the logit of the token whose probability crosses `top_p` (-inf where top_p is 2,
    off), over the tokens at or above `floor`: the (B, W) descending `window` holds them all but
    those tied with the floor past its end, which count in the normaliser."""
    largest = window[:, :1]
    total = (x - largest).exp().masked_fill(x < floor, 0).sum(-1, keepdim=True)
    probs = (window - largest).exp().masked_fill(window < floor, 0) / total
    before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each
    crossing = ((before < top_p).sum(-1, keepdim=True) - 1).clamp(min=0)  # p below float32: 0
    return torch.where(top_p < 1, window.gather(-1, crossing), float("-inf"))


def sample_rows(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """(B, V) logits (grammar-masked where a request has a grammar) -> (B,) tokens: greedy rows
    the processed logits' argmax, the others a draw from their truncated distribution, all on
    the device without a host read."""
    x = process_rows(logits, rows)
    greedy = [row.params.greedy for row in rows]
    if all(greedy):
        return argmax_rows(x)
    drawn = _race(truncate_rows(x, rows).softmax(-1), _noise(x, rows))
    if not any(greedy):
        return drawn
    return torch.where(torch.tensor(greedy, device=x.device), argmax_rows(x), drawn)


def _noise(x: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """(B, V) Exp(1) draws: a seeded row's from its own generator (so a seed
    draws the same tokens whatever batch holds it), the others' from the device's default."""
    noise = torch.empty_like(x, dtype=torch.float32).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # no 0/0 on a masked token


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities (any positive scale) -> (B,) columns drawn in proportion to them:
    the exponential race (Gumbel-max), argmax p / Exp(1)."""
    return (probs / noise).argmax(-1)


def _uniform(rows: list[Row], device: torch.device) -> torch.Tensor:
    """(B,) U[0, 1) draws, a seeded row's from its own generator."""
    u = torch.rand(len(rows), device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i : i + 1].uniform_(generator=row.generator)
    return u


def verify_rows(logits: torch.Tensor, drafts: list[list[int]], rows: list[Row]) -> list[list[int]]:
    """Speculative decoding's verification of a batch of chunks: (R, V) raw logits, each chunk's
    k + 1 rows in turn (those that fed its pending token and its k `drafts` tokens), one Row per
    chunk -> per chunk its accepted draft tokens and one more (a correction, or the bonus token
    after all k), with one host read for the batch.

    Row i is processed as a plain step after the chunk's first i draft tokens would be (its
    penalties count them as output). Greedy: a draft token is accepted when it is the argmax,
    so the tokens are exactly the plain ones. Sampled: the draft is deterministic, so token d is
    accepted with the target's probability p(d), and on rejection the token is drawn from p with
    d removed, renormalised; each token then follows p exactly (rejection sampling with a
    one-hot proposal)."""
    assert logits.shape[0] == sum(len(draft) + 1 for draft in drafts), "k + 1 rows per chunk"
    expanded = [
        _after(row, draft[:i])
        for row, draft in zip(rows, drafts, strict=True)
        for i in range(len(draft) + 1)
    ]
    x = process_rows(logits, expanded)
    proposed = [t for draft in drafts for t in [*draft, -1]]  # -1: a bonus row proposes none
    picks = argmax_rows(x)
    if all(row.params.greedy for row in expanded):
        tokens = picks.tolist()
        return _accepted(drafts, tokens, [t == d for t, d in zip(tokens, proposed, strict=True)])
    drawn, accepted = _rejection_sample(x, expanded, proposed)
    greedy = torch.tensor([row.params.greedy for row in expanded], device=x.device)
    tokens = torch.where(greedy, picks, drawn)
    accepted = torch.where(greedy, picks == torch.tensor(proposed, device=x.device), accepted)
    tokens, accepted = torch.stack([tokens, accepted.long()]).tolist()
    return _accepted(drafts, tokens, accepted)


def _after(row: Row, accepted: list[int]) -> Row:
    """The row of a verify step that follows `accepted` draft tokens: they count as output."""
    if not accepted or not (row.counts_output or row.params.repetition_penalty != 1.0):
        return row
    return replace(row, output_ids=[*row.output_ids, *accepted])


def _rejection_sample(x: torch.Tensor, rows: list[Row], proposed: list[int]):
    """(R, V) processed logits -> (R,) each row's token if its proposal is rejected (drawn from
    its distribution without the proposal) and (R,) whether the proposal is accepted (u < p)."""
    probs = truncate_rows(x, rows).softmax(-1)  # (R, V)
    draft_rows = [i for i, t in enumerate(proposed) if t >= 0]
    index = (
        torch.tensor(draft_rows, device=x.device),
        torch.tensor([proposed[i] for i in draft_rows], device=x.device),
    )
    accepted = torch.zeros(len(rows), dtype=torch.bool, device=x.device)
    accepted[index[0]] = _uniform(rows, x.device)[index[0]] < probs[index]
    residual = probs.index_put(index, torch.zeros((), device=x.device))
    return _race(residual, _noise(x, rows)), accepted


def _accepted(drafts: list[list[int]], tokens: list[int], accepted: list[bool]) -> list[list[int]]:
    """Per chunk: its draft tokens up to the first one rejected, then that row's token (after
    all of them, the bonus row's). `tokens`, `accepted`: per verify row, chunk after chunk."""
    out, at = [], 0
    for draft in drafts:
        n = next((i for i, ok in enumerate(accepted[at : at + len(draft)]) if not ok), len(draft))
        out.append([*draft[:n], tokens[at + n]])
        at += len(draft) + 1
    return out


ARGMAX_CHUNKS = 64


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) each row's first largest index, in two passes where V splits into
    ARGMAX_CHUNKS chunks: PyTorch reduces a row with one block of threads, so a single
    sequence's argmax runs on one SM (a 128k vocabulary on the H200: 26 us of GPU time, 16 in
    two passes)."""
    b, v = logits.shape
    if v % ARGMAX_CHUNKS:
        return logits.argmax(-1)
    best, at = logits.view(b, ARGMAX_CHUNKS, v // ARGMAX_CHUNKS).max(-1)  # (B, chunks)
    chunk = best.argmax(-1, keepdim=True)  # the first chunk holding the largest value
    return (chunk * (v // ARGMAX_CHUNKS) + at.gather(-1, chunk))[:, 0]


def logprob_rows(
    logits: torch.Tensor, tokens: list[int], ks: list[int | None]
) -> list[dict[int, float] | None]:
    """Per row of (B, V) raw logits (the model's distribution, before any sampling step), None
    where its k is None, else {token id: log-prob} of its token and its k likeliest ones."""
    wanted = [i for i, k in enumerate(ks) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(ks)
    if not wanted:
        return out
    if len(wanted) < len(ks):
        logits = logits.index_select(0, torch.tensor(wanted, device=logits.device))
    logprobs = logits.float().log_softmax(-1)
    chosen = torch.tensor([tokens[i] for i in wanted], device=logits.device)[:, None]
    values, ids = logprobs.topk(max(ks[i] for i in wanted))
    values = torch.cat([logprobs.gather(-1, chosen), values], dim=1).tolist()
    for i, row_values, row_ids in zip(wanted, values, ids.tolist(), strict=True):
        k = ks[i]
        out[i] = {tokens[i]: row_values[0]}
        out[i].update(zip(row_ids[:k], row_values[1 : k + 1], strict=True))
    return out
