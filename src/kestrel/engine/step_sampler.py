"""A step's sampling: the rows of every runner's step drawn as one batch through
kestrel.sampling's batched functions, plain rows and speculative chunks alike, with one host read.

Seeded requests keep their generator here from their first draw to their release, across
preemption, so a seed gives the same tokens whatever batch the request is in.
"""

import itertools
from dataclasses import dataclass

import torch

from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk
from kestrel.sampling import Row, logprob_rows, make_generator, sample_rows, verify_rows


@dataclass
class StepResult:
    """What one chunk produced: a sampled token (when the chunk samples), an embedding request's
    vector (when its prompt's last chunk ran) or the error it raised."""

    request: Request
    token: int | None = None
    logprobs: dict[int, float] | None = None
    error: BaseException | None = None
    embedding: list[float] | None = None
    # a speculative chunk's tokens: its accepted draft tokens and one more (`token` is the
    # first), with their log-probs when asked; None: one token, as `token`
    tokens: list[int] | None = None
    token_logprobs: list[dict[int, float]] | None = None


class StepSampler:
    """The one sampler of a runner's steps (the runner owns its caches; this, the draws)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def sample(
        self, requests: list[Request], raw: torch.Tensor, logits: torch.Tensor, errors: dict
    ) -> list[StepResult]:
        """A token per request from its row of (S, V) `logits` (grammar-masked), drawn as one
        batch with one host read; log-probs from the `raw` ones. `errors`: {request id: error}
        of requests that failed before their draw (they draw nothing)."""
        keep = [i for i, r in enumerate(requests) if r.request_id not in errors]
        drawn = {}
        if keep:
            rows = [self._row(requests[i]) for i in keep]
            tokens = sample_rows(_take(logits, keep), rows).tolist()
            ks = [row.params.logprobs for row in rows]
            logprobs = logprob_rows(_take(raw, keep), tokens, ks)
            drawn = dict(zip(keep, zip(tokens, logprobs, strict=True), strict=True))
        return [
            StepResult(r, *drawn[i]) if i in drawn else StepResult(r, error=errors[r.request_id])
            for i, r in enumerate(requests)
        ]

    def verify(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, errors: dict
    ) -> list[StepResult]:
        """Each speculative chunk's tokens from its k + 1 rows of (R, V) `logits`, verified as one
        batch (`errors` as in `sample`)."""
        starts = list(itertools.accumulate((len(c.draft) + 1 for c in chunks), initial=0))
        keep = [s for s, c in enumerate(chunks) if c.request.request_id not in errors]
        index = [r for s in keep for r in range(starts[s], starts[s + 1])]
        verified = (
            self._verify_rows([chunks[s] for s in keep], _take(logits, index)) if keep else {}
        )
        return [
            verified.get(c.request.request_id)
            or StepResult(c.request, error=errors[c.request.request_id])
            for c in chunks
        ]

    def _verify_rows(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> dict:
        """{request id: its StepResult} of chunks whose rows fill `logits`."""
        rows = [self._row(c.request) for c in chunks]
        tokens = verify_rows(logits, [c.draft for c in chunks], rows)
        logprobs = self._verify_logprobs(logits, chunks, tokens)
        results = {}
        for chunk, kept, lp in zip(chunks, tokens, logprobs, strict=True):
            request = chunk.request
            first = None if lp is None else lp[0]
            results[request.request_id] = StepResult(
                request, kept[0], first, tokens=kept, token_logprobs=lp
            )
        return results

    def _verify_logprobs(self, logits, chunks, tokens) -> list[list | None]:
        """Per chunk, the log-probs of its verified tokens from its rows of `logits` (None: not
        asked)."""
        flat, ks = [], []
        for chunk, kept in zip(chunks, tokens, strict=True):
            rejected = len(chunk.draft) + 1 - len(kept)
            flat += kept + [0] * rejected
            ks += [chunk.request.params.logprobs] * len(kept) + [None] * rejected
        per_row, out, at = logprob_rows(logits, flat, ks), [], 0
        for chunk, kept in zip(chunks, tokens, strict=True):
            asked = chunk.request.params.logprobs is not None
            out.append(per_row[at : at + len(kept)] if asked else None)
            at += len(chunk.draft) + 1
        return out

    def _row(self, request: Request) -> Row:
        params = request.params
        return Row(params, self.generator(request), request.prompt_ids, request.output_ids)

    def generator(self, request: Request) -> torch.Generator | None:
        """A seeded request's sampler state: made at its first draw, kept across preemption
        (None: unseeded, its rows draw from the device's default generator)."""
        if request.params.seed is None:
            return None
        if request.request_id not in self.generators:
            self.generators[request.request_id] = make_generator(request.params.seed, self.device)
        return self.generators[request.request_id]

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`rows` of x (x itself when they are all of its rows, in order)."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, torch.tensor(rows, device=x.device))
