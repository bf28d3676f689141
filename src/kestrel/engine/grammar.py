"""Grammar masks: each constrained request's llguidance matcher, the batch's token bitmask and its
application to the logits on the device.

The bitmask of a step is computed on the host in a worker thread while the forward runs (it
depends only on the tokens already sampled), so a constrained batch pays for it only where the
mask takes longer than the forward. Rows of unconstrained requests allow every token, so free and
constrained requests share one batch and one sampling kernel.
"""

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kestrel.engine.request import Request

BITS = 32  # llguidance packs the allowed-token set 32 tokens to an int32


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self._lltokenizer = None  # built at the first constrained request (about a second)
        self._executor = None
        self._buffer: torch.Tensor | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kestrel-grammar")

    def start(self, requests: list[Request]) -> Future | None:
        """The bitmask of `requests` (one row each; None when none is constrained), computed in
        the worker thread: start it before the forward, read it after."""
        rows = [(i, r) for i, r in enumerate(requests) if r.params.structured_output]
        if not rows:
            return None
        return self._thread.submit(self._bitmask, len(requests), rows)

    def apply(self, bitmask: Future | None, logits: torch.Tensor) -> torch.Tensor:
        """(R, V) logits with the tokens each row's grammar forbids at -inf (a copy; the raw
        logits stay for log-probs). Unconstrained rows are unchanged."""
        if bitmask is None:
            return logits
        mask = bitmask.result().to(logits.device, non_blocking=True)  # (R, ceil(V / 32))
        shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(mask.shape[0], -1)
        rows = logits[: mask.shape[0]]
        return rows.masked_fill(allowed[:, : rows.shape[1]] == 0, float("-inf"))

    def accept(self, request: Request, token: int) -> None:
        """Advance the request's matcher past its sampled token; ValueError if the grammar
        rejects it (only a matcher in error can: the mask allowed the token)."""
        matcher = self.matchers.get(request.request_id)
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError(f"the output no longer matches its grammar: {matcher.get_error()}")

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    # -- the worker thread ----------------------------------------------------------------------

    def _bitmask(self, size: int, rows: list[tuple[int, Request]]) -> torch.Tensor:
        bitmask = self._host_buffer(size)[:size]
        bitmask.fill_(-1)  # every token allowed
        matchers = [(self._matcher(request), i) for i, request in rows]
        llguidance.torch.fill_next_token_bitmask_par(self._parallel(), matchers, bitmask)
        return bitmask

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
            grammar = request.params.structured_output.grammar()
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
            if matcher.is_error():
                raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
            self.matchers[request.request_id] = matcher
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
