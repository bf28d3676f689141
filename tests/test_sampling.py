"""Sampling: validation, greedy, penalties, truncation, seeds, log-probs."""

import math

import pytest
import torch

from kestrel.errors import InvalidRequestError
from kestrel.sampling import (
    SamplingParams,
    check_token_ids,
    make_generator,
    process_logits,
    sample,
    top_logprobs,
    truncate,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e9),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("n", 0),
        ("n", 10**6),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("min_p", 2),
        ("logprobs", 21),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("logit_bias", {1: 1000}),
        ("repetition_penalty", 0),
    ],
)
def test_out_of_range_params_name_the_param(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


def test_edge_values_are_valid():
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=0, logprobs=20, seed=0)


def test_logit_bias_keys_must_be_tokens():
    with pytest.raises(InvalidRequestError, match="not in"):
        check_token_ids(SamplingParams(logit_bias={99: 1.0}), vocab_size=5)


def test_greedy_takes_the_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), None, [], []) == 4


def test_logit_bias_changes_the_choice():
    params = SamplingParams(temperature=0, logit_bias={1: 5.0})
    assert sample(LOGITS, params, None, [], []) == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    out = process_logits(LOGITS, SamplingParams(repetition_penalty=2.0), [0, 3], [])
    assert out[0] == 1.0 and out[3] == -2.0 and out[4] == 3.0


def test_presence_and_frequency_penalties_use_output_counts():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(LOGITS, params, [1], [4, 4, 2])
    assert out[4] == pytest.approx(3.0 - 0.5 - 0.5) and out[2] == pytest.approx(0.5 - 0.25 - 0.5)
    assert out[1] == 1.0  # prompt tokens are not penalised by presence/frequency


def test_top_k_top_p_min_p_mask_the_tail():
    assert torch.isinf(truncate(LOGITS, SamplingParams(top_k=2))).tolist() == [
        False,
        True,
        True,
        True,
        False,
    ]
    kept = ~torch.isinf(truncate(LOGITS, SamplingParams(top_p=0.6)))
    assert kept.tolist() == [False, False, False, False, True]
    probs = LOGITS.softmax(-1)
    kept = ~torch.isinf(truncate(LOGITS, SamplingParams(min_p=0.3)))
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()


def test_top_p_and_min_p_after_top_k_mask_as_over_the_whole_vocabulary():
    """truncate applies top-p and min-p to the top-k survivors only; the masks equal the plain
    ones over all tokens (llama-server's defaults combine all three)."""
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000) * 3
        for params in (
            SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
            SamplingParams(top_k=5, top_p=0.5),
            SamplingParams(top_k=100, min_p=0.2),
        ):
            tempered = logits / params.temperature
            kth = torch.topk(tempered, params.top_k).values[-1]
            plain = tempered.masked_fill(tempered < kth, float("-inf"))
            probs = plain.softmax(-1)
            order = probs.argsort(descending=True)
            before = probs[order].cumsum(-1) - probs[order]
            keep = torch.zeros_like(probs, dtype=torch.bool)
            keep[order] = (before < params.top_p) | (torch.arange(len(order)) == 0)
            keep &= probs >= params.min_p * probs[keep].max()
            out = truncate(logits, params)
            assert (~torch.isinf(out)).tolist() == keep.tolist()
            assert torch.equal(out[keep], tempered[keep])


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0])
    kept = ~torch.isinf(truncate(logits, SamplingParams(top_k=2, top_p=0.99)))
    assert kept.tolist() == [True, True, True, True, False]


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    kept = ~torch.isinf(truncate(logits, SamplingParams(top_p=0.7)))
    assert kept.tolist() == [True, True, False]


def test_seed_makes_sampling_reproducible():
    params = SamplingParams(temperature=1.0, seed=42)

    def draws():
        generator = make_generator(42, torch.device("cpu"))
        return [sample(LOGITS, params, generator, [], []) for _ in range(20)]

    assert draws() == draws()
    assert len(set(draws())) > 1


def test_top_logprobs_include_sampled_token():
    result = top_logprobs(LOGITS, token=3, k=2)
    assert set(result) == {3, 4, 0}
    assert result[4] == pytest.approx(float(LOGITS.log_softmax(-1)[4]))


def test_tiny_top_p_keeps_the_likeliest_token():
    # found by fuzzing: a top_p that rounds to 0 in float32 masked every token (NaN probabilities)
    kept = ~torch.isinf(truncate(LOGITS, SamplingParams(top_p=1e-85)))
    assert kept.tolist() == [False, False, False, False, True]


def test_tiny_temperature_is_greedy_not_nan():
    params = SamplingParams(temperature=1e-300)
    assert sample(LOGITS, params, make_generator(0, torch.device("cpu")), [], []) == 4
