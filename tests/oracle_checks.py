"""The comparison every outside-oracle test makes: kestrel's logits of a checkpoint, the whole
prompt and in chunks of 5, within an absolute tolerance of the oracle's."""

import torch
from tests.reference import chunked_logits


def assert_logits_match(model, name: str, expected: torch.Tensor, prompt, atol: float) -> float:
    """Prints and returns the largest difference seen (the docs' tables quote it)."""
    gap = 0.0
    for chunk in (len(prompt), 5):
        actual = chunked_logits(model, prompt, chunk)
        gap = max(gap, (actual - expected).abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=0, atol=atol)
    print(f"{name}: max |kestrel - oracle| {gap:.2e}, max |logit| {expected.abs().max():.2f}")
    return gap
