"""Sampling: validation, and the one batched sampler (greedy, penalties, truncation and its tie
rule, seeds whatever the batch, log-probs)."""

import math

import pytest
import torch

from kestrel.errors import InvalidRequestError
from kestrel.sampling import (
    Row,
    SamplingParams,
    check_token_ids,
    logprob_rows,
    make_generator,
    process_rows,
    sample_rows,
    truncate_rows,
)

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


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


def sample(logits, params, generator=None, prompt_ids=(), output_ids=()) -> int:
    """One row through the batched sampler."""
    row = Row(params, generator, prompt_ids, output_ids)
    return int(sample_rows(logits[None], [row])[0])


def processed(logits, params, prompt_ids=(), output_ids=()) -> torch.Tensor:
    return process_rows(logits[None], [Row(params, None, prompt_ids, output_ids)])[0]


def kept(logits, params) -> list[bool]:
    """Which tokens truncation keeps, in vocabulary order."""
    out = truncate_rows(logits[None] / params.temperature, [Row(params)])[0]
    return (~torch.isinf(out)).tolist()


def test_greedy_takes_the_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0)) == 4


def test_logit_bias_changes_the_choice():
    assert sample(LOGITS, SamplingParams(temperature=0, logit_bias={1: 5.0})) == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    out = processed(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0), [0, 3])
    assert out[0] == 1.0 and out[3] == -2.0 and out[4] == 3.0


def test_presence_and_frequency_penalties_use_output_counts():
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    out = processed(LOGITS, params, [1], [4, 4, 2])
    assert out[4] == pytest.approx(3.0 - 0.5 - 0.5) and out[2] == pytest.approx(0.5 - 0.25 - 0.5)
    assert out[1] == 1.0  # prompt tokens are not penalised by presence/frequency


def test_rows_of_a_batch_are_processed_each_with_its_own_params():
    """Bias, penalties and temperature land on their own row only: the batch equals its rows
    processed alone."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [
        Row(SamplingParams(logit_bias={3: 2.0, 7: -100.0}, temperature=0.5)),
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(repetition_penalty=1.3), None, [1, 2, 2, 9], [9, 11]),
        Row(SamplingParams(presence_penalty=0.4, frequency_penalty=-0.3), None, [5], [5, 6, 6]),
    ]
    batch = process_rows(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(batch[i], process_rows(logits[i : i + 1], [row])[0])
    assert torch.equal(batch[1], logits[1])  # greedy: temperature 1


def test_top_k_top_p_min_p_mask_the_tail():
    assert kept(LOGITS, SamplingParams(top_k=2)) == [True, False, False, False, True]
    assert kept(LOGITS, SamplingParams(top_p=0.6)) == [False, False, False, False, True]
    probs = LOGITS.softmax(-1)
    assert kept(LOGITS, SamplingParams(min_p=0.3)) == (probs >= 0.3 * probs.max()).tolist()


def test_top_p_and_min_p_after_top_k_mask_as_over_the_whole_vocabulary():
    """top-p and min-p see only the top-k survivors; the masks equal the plain ones over all
    tokens (llama-server's defaults combine all three)."""
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
            assert kept(logits, params) == keep.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_keeps_every_tied_token_in_the_draw(device):
    """The tie rule (vLLM's threshold): top-k keeps every token whose logit equals the k-th
    largest, so with k = 2 and three tokens tied second, all four are drawn, never the fifth."""
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0], device=device)
    params = SamplingParams(temperature=2.0, top_k=2)
    assert kept(logits, params) == [True, True, True, True, False]
    # the ties past top-k's window of k logits still count in top-p's mass
    assert kept(logits, SamplingParams(top_k=2, top_p=0.99)) == [True, True, True, True, False]
    tokens = sample_rows(logits.expand(4000, -1), [Row(params)] * 4000)
    counts = torch.bincount(tokens.cpu(), minlength=5).tolist()
    assert all(n > 0 for n in counts[:4]) and counts[4] == 0, counts


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert kept(logits, SamplingParams(top_p=0.7)) == [True, True, False]


def test_top_p_keeps_every_token_tied_with_the_one_that_crosses_p():
    logits = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))
    assert kept(logits, SamplingParams(top_p=0.5)) == [True, True, True, True]
    assert kept(logits, SamplingParams(top_p=0.3)) == [True, False, False, False]


def test_a_batch_draws_each_row_from_its_own_distribution():
    """Greedy and sampled rows side by side: the greedy rows take their argmax, the sampled
    ones only tokens their truncation keeps, in proportion (top-k 2 over [0.5, 0.3, ...])."""
    logits = torch.log(torch.tensor([0.05, 0.5, 0.3, 0.15]))
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(top_k=2))] * 3000
    tokens = sample_rows(logits.expand(len(rows), -1), rows)
    assert set(tokens[0::2].tolist()) == {1}
    share = (tokens[1::2] == 1).float().mean().item()
    assert set(tokens[1::2].tolist()) == {1, 2} and abs(share - 0.5 / 0.8) < 0.03


def test_seed_makes_sampling_reproducible():
    params = SamplingParams(temperature=1.0, seed=42)

    def draws():
        generator = make_generator(42, torch.device("cpu"))
        return [sample(LOGITS, params, generator) for _ in range(20)]

    assert draws() == draws()
    assert len(set(draws())) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_draws_the_same_tokens_whatever_batch_holds_it(device):
    """A seed reproduces its tokens alone, or at any place in a batch of other rows (seeded or
    not, other params), step after step."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300).to(device)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    others = [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(seed=8)]

    def run(place: int, batch: int) -> list[int]:
        mine, theirs = make_generator(3, logits.device), make_generator(8, logits.device)
        tokens = []
        for _ in range(10):
            rows = [Row(p, theirs if p.seed else None) for p in others[: batch - 1]]
            rows.insert(place, Row(params, mine))
            x = logits[:batch].roll(place, 0)
            tokens.append(int(sample_rows(x, rows)[place]))
        return tokens

    alone = run(0, 1)
    assert len(set(alone)) > 1
    assert run(1, 3) == alone and run(3, 4) == alone and run(0, 4) == alone


def test_logprobs_include_the_sampled_token():
    (result,) = logprob_rows(LOGITS[None], [3], [2])
    assert set(result) == {3, 4, 0}
    assert result[4] == pytest.approx(float(LOGITS.log_softmax(-1)[4]))


def test_logprobs_per_row_only_where_asked():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    result = logprob_rows(logits, [0, 0, 1], [None, 1, 0])
    assert result[0] is None
    assert list(result[1]) == [0] and list(result[2]) == [1]  # the sampled token is the top one


def test_tiny_top_p_keeps_the_likeliest_token():
    # found by fuzzing: a top_p that rounds to 0 in float32 masked every token (NaN probabilities)
    assert kept(LOGITS, SamplingParams(top_p=1e-85)) == [False, False, False, False, True]


def test_tiny_temperature_is_greedy_not_nan():
    params = SamplingParams(temperature=1e-300)
    assert sample(LOGITS, params, make_generator(0, torch.device("cpu"))) == 4
