"""Speculative decoding's proposals, in plain Python (the scheduler calls it; no torch here).

n-gram prompt lookup: the continuation, in the sequence's own tokens (prompt and output), of the
latest earlier occurrence of its last n tokens, trying the longest n first. It costs no forward
and proposes well when the output copies the input (code edits, summaries, RAG answers). The
runner verifies every proposed token in one forward (engine/paged_runner.py) and keeps only
those the target model would have produced (sampling.verify_rows), so the output is unchanged.
"""

from array import array

from kestrel.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.ngram_min, config.ngram_max

    def propose_all(self, requests: list, most: list[int]) -> list[list[int]]:
        """Per request (engine/request.py's), its proposal of at most `most` tokens."""
        return [self.propose(r.all_ids, m) for r, m in zip(requests, most, strict=True)]

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def propose(self, ids: list[int], most: int) -> list[int]:
        """Up to min(k, most) tokens to follow `ids`: what followed the latest earlier match of
        its last n tokens (n from n_max down to n_min); [] when nothing matches."""
        k = min(self.k, most)
        if k <= 0:
            return []
        data = array("i", ids).tobytes()  # 4 bytes a token: the search runs in C (bytes.rfind)
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            start = _latest_match(data, n)
            if start is not None:
                return ids[start + n : start + n + k]
        return []


def _latest_match(data: bytes, n: int) -> int | None:
    """The start (in tokens) of the latest occurrence of the last n tokens of `data` that ends
    before its last token."""
    tail, end = data[-4 * n :], len(data) - 4
    while (at := data.rfind(tail, 0, end)) >= 0:
        if at % 4 == 0:
            return at // 4
        end = at + len(tail) - 1  # a match across token boundaries: look before it
    return None


def make_proposer(config: SpeculativeConfig) -> NgramProposer | None:
    """The proposer --speculative names (None: off)."""
    if config.speculative == "ngram":
        return NgramProposer(config)
    return None
