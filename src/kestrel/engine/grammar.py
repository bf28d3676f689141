"""Grammar masks: each constrained request's llguidance matcher, the batch's token bitmask and its
application to the logits on the device.

Off the critical path: a step's sampled tokens are only noted (`accept`); the next step's worker
thread feeds them to the matchers and computes the bitmask while the forward runs (both depend
only on tokens already sampled), so a constrained batch waits for the grammar only where it takes
longer than the forward. Rows of unconstrained requests allow every token, so free and
constrained requests share one batch and one sampling kernel.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kestrel.engine.request import Request
from kestrel.structured import StructuredOutput

BITS = 32  # llguidance packs the allowed-token set 32 tokens to an int32
COMPILED_KEPT = 64  # compiled grammars kept, least recently used dropped first


@dataclass
class StepMasks:
    """A step's grammar work: one bitmask row per sampling request (-1: all allowed), and the
    requests whose grammar failed (they fail instead of sampling)."""

    bitmask: torch.Tensor  # (R, ceil(V / 32)) int32, on the host
    errors: dict[str, Exception] = field(default_factory=dict)


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.pending: dict[str, int] = {}  # sampled tokens not yet fed to their matcher
        self._lltokenizer = None  # built at the first constrained request (about a second)
        self._executor = None
        self._buffer: torch.Tensor | None = None
        self._cache: dict[StructuredOutput, llguidance.LLMatcher] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kestrel-grammar")

    def start(self, requests: list[Request]) -> Future | None:
        """The StepMasks of `requests` (None when none is constrained), computed in the worker
        thread: start it before the forward, read it after."""
        rows = [(i, r) for i, r in enumerate(requests) if r.params.structured_output]
        if not rows:
            return None
        return self._thread.submit(self._step_masks, len(requests), rows)

    def apply(self, masks: StepMasks, logits: torch.Tensor) -> torch.Tensor:
        """(R, V) logits with the tokens each row's grammar forbids at -inf (a copy; the raw
        logits stay for log-probs). Unconstrained rows are unchanged."""
        mask = masks.bitmask.to(logits.device, non_blocking=True)
        shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1)
        rows = logits[: mask.shape[0]]
        return rows.masked_fill(allowed[:, : rows.shape[1]] == 0, float("-inf"))

    def accept(self, sampled: list[tuple[Request, int]]) -> None:
        """Note each constrained request's sampled token; the next step's worker feeds it."""
        for request, token in sampled:
            if request.params.structured_output:
                self.pending[request.request_id] = token

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.pending.pop(request_id, None)

    # -- the worker thread ----------------------------------------------------------------------

    def _step_masks(self, size: int, rows: list[tuple[int, Request]]) -> StepMasks:
        masks = StepMasks(self._host_buffer(size)[:size])
        masks.bitmask.fill_(-1)  # every token allowed
        live = []
        for i, request in rows:
            try:
                live.append((i, request, self._matcher(request)))
            except Exception as error:  # compiles, so only the library's own failure
                masks.errors[request.request_id] = error
        masks.errors.update(self._consume_pending([(r, m) for _, r, m in live]))
        matchers = [(m, i) for i, r, m in live if r.request_id not in masks.errors]
        llguidance.torch.fill_next_token_bitmask_par(self._parallel(), matchers, masks.bitmask)
        return masks

    def _consume_pending(self, live: list[tuple[Request, llguidance.LLMatcher]]) -> dict:
        """Feed the last step's tokens, in parallel; errors of the rejected (only a matcher in
        error can reject: the mask allowed the token)."""
        fed = [
            (r, m, self.pending.pop(r.request_id)) for r, m in live if r.request_id in self.pending
        ]
        if not fed:
            return {}
        pairs = [(m, token) for _, m, token in fed]
        accepted = llguidance.torch.consume_token_par(self._parallel(), pairs)
        return {
            r.request_id: ValueError(f"the output no longer matches its grammar: {m.get_error()}")
            for (r, m, _), ok in zip(fed, accepted, strict=True)
            if not ok
        }

    def _host_buffer(self, size: int) -> torch.Tensor:
        """One pinned buffer, grown as batches grow (pinning per step would cost more than the
        mask). Reusing it is safe: a step's sampling reads its tokens, which waits for the copy."""
        if self._buffer is None or self._buffer.shape[0] < size:
            words = -(-self.vocab_size // BITS)
            pin = torch.cuda.is_available()
            self._buffer = torch.empty((size, words), dtype=torch.int32, pin_memory=pin)
        return self._buffer

    def _matcher(self, request: Request) -> llguidance.LLMatcher:
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            matcher = self._compiled(request.params.structured_output).deep_copy()
            self.matchers[request.request_id] = matcher
        return matcher

    def _compiled(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of `constraint`, compiled once: requests with the same schema (n > 1,
        a client's every call) copy it instead of compiling again."""
        matcher = self._cache.pop(constraint, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._tokenizer(), constraint.grammar())
            if matcher.is_error():
                raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        self._cache[constraint] = matcher  # most recently used last
        while len(self._cache) > COMPILED_KEPT:
            self._cache.pop(next(iter(self._cache)))
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._lltokenizer

    def _parallel(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor
