"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

import pytest

from kestrel.tokenizer import IncrementalDetokenizer, StopStringMatcher, stop_token_ids

TEXTS = [
    "Hello, world! 🦅 Kestrels hover.",
    "日本語のテキスト、そして emoji 👩‍👩‍👧",
    "  spaces\n\ttabs  ",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_text_and_never_split_a_character(smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids=[])
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == smollm2_tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_held_back(smollm2_tokenizer):
    ids = smollm2_tokenizer("🦅")["input_ids"]
    assert len(ids) > 1  # a byte-level tokenizer spreads the emoji over several tokens
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids=[])
    deltas = [detok.push(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦅"


def test_stop_string_cuts_text_and_holds_back_partial_matches():
    matcher = StopStringMatcher(["STOP"])
    matcher.feed("hello ST")
    assert matcher.streamable(finished=False) == "hello"  # "ST" may start "STOP"
    matcher.feed("OP and more")
    assert matcher.stopped and matcher.text == "hello "


def test_stop_string_can_be_included():
    matcher = StopStringMatcher(["\n\n"], include_stop=True)
    for piece in ["a\n", "\nb"]:
        matcher.feed(piece)
    assert matcher.stopped and matcher.text == "a\n\n"


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo"])
    matcher.feed("hello world")
    assert matcher.text == "hel"


def test_end_of_turn_tokens_stop(smollm2_tokenizer):
    class Config:
        eos_token_id = 2

    ids = stop_token_ids(smollm2_tokenizer, Config())
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") in ids


def test_gemma4_tool_response_ends_the_turn(smollm2_tokenizer):
    """Gemma 4 writes `<|tool_response>` after its calls, where its template puts the results
    (its generation_config lists it among the EOS ids; a GGUF file may not)."""
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_response>"]})

    class Config:
        eos_token_id = 2

    ids = stop_token_ids(tokenizer, Config())
    assert tokenizer.convert_tokens_to_ids("<|tool_response>") in ids
