"""Speculative decoding's proposals, in plain Python (the scheduler calls it; no torch here).

n-gram prompt lookup: the continuation, in the sequence's own tokens (prompt and output), of the
latest earlier occurrence of its last n tokens, trying the longest n first. It costs no forward
and proposes well when the output copies the input (code edits, summaries, RAG answers). The
runner verifies every proposed token in one forward (engine/paged_runner.py) and keeps only
those the target model would have produced (sampling.verify_draft), so the output is unchanged.
"""

from kestrel.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.ngram_min, config.ngram_max

    def propose(self, ids: list[int], most: int) -> list[int]:
        """Up to min(k, most) tokens to follow `ids`: what followed the latest earlier match of
        its last n tokens (n from n_max down to n_min); [] when nothing matches."""
        k = min(self.k, most)
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(ids) - 1), self.n_min - 1, -1):
            start = _latest_match(ids, n)
            if start is not None:
                return ids[start + n : start + n + k]
        return []


def _latest_match(ids: list[int], n: int) -> int | None:
    """The start of the latest occurrence of ids[-n:] that ends before the last token."""
    tail, last = ids[-n:], ids[-1]
    for start in range(len(ids) - n - 1, -1, -1):
        if ids[start + n - 1] == last and ids[start : start + n] == tail:
            return start
    return None


def make_proposer(config: SpeculativeConfig) -> NgramProposer | None:
    """The proposer --speculative names (None: off)."""
    if config.speculative == "ngram":
        return NgramProposer(config)
    return None
