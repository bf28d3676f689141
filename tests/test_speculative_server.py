"""`kestrel serve --speculative ngram` and `--speculative draft` (SmolLM2 drafting for itself) on
the embedded SmolLM2, through the real openai client: greedy answers equal those of the server
without speculation, usage reports the proposed tokens (OpenAI's accepted/rejected prediction
tokens) and /metrics counts them. Bad flags fail at the command line, naming the flag."""

import subprocess
import sys

import pytest
from tests.server_fixtures import SMOLLM2_ARGS, SMOLLM2_ENV, shared_server

CODE = """def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.quantity
    return result
"""
PROMPT = f"Rewrite this Python code, renaming `items` to `products`:\n\n{CODE}"


def answer(server, **extra):
    return server.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=60,
        temperature=0,
        **extra,
    )


@pytest.mark.parametrize(
    "method", [["ngram"], ["draft", "--draft-model", "smollm2"]], ids=["ngram", "draft"]
)
def test_speculative_server_answers_as_the_plain_one_and_counts_proposals(server, method):
    spec = shared_server((*SMOLLM2_ARGS, "--speculative", *method), SMOLLM2_ENV)
    before = spec.metrics()
    plain, fast = answer(server), answer(spec)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    details = fast.usage.completion_tokens_details
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert accepted > 0 and accepted + rejected > 0
    after = spec.metrics()
    drafted = "kestrel_spec_decode_draft_tokens_total"
    taken = "kestrel_spec_decode_accepted_tokens_total"
    assert after[drafted] - before.get(drafted, 0) == accepted + rejected
    assert after[taken] - before.get(taken, 0) == accepted
    assert plain.usage.completion_tokens_details is None


def test_bad_speculative_flags_name_the_flag():
    for args, flag in [
        (["--speculative", "eagle"], "--speculative"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--speculative", "ngram", "--ngram-min", "5", "--ngram-max", "3"], "--ngram-min"),
        (["--speculative", "draft"], "--draft-model"),
        (["--draft-model", "smollm2"], "--draft-model"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "kestrel", "generate", "-p", "hi", "-n", "2", *args],
            capture_output=True,
            text=True,
        )
        assert run.returncode != 0 and flag in run.stderr, run.stderr
