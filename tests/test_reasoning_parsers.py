"""Reasoning parsers without a server: the published chat templates (llama.cpp's copies, EXAONE 4.0's
in tests/data) on SmolLM2's real tokenizer choose the parser and say where an answer begins; the
streaming split equals the whole answer's for every way of cutting the text into deltas, holds
back a marker split across deltas, and leaves tool calls in the reasoning alone; the grammar
after the thinking accepts the thinking free and the answer only as constrained."""

from pathlib import Path

import llguidance
import llguidance.hf
import pytest
from tests.llama_cpp_tools import LLAMA_CPP

from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.reasoning import (
    PARSERS,
    Phase,
    ReasoningStream,
    Thinking,
    parser_name,
    split,
    template_kwargs,
)
from kestrel.server.tools.parsers import PARSERS as TOOL_PARSERS
from kestrel.structured import json_schema

TEMPLATES = LLAMA_CPP / "models" / "templates"
DATA = Path(__file__).parent / "data"
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]

# template -> (the parser auto picks, where an answer begins by default, with enable_thinking
# on, with it off)
FAMILIES = {
    TEMPLATES / "Qwen-Qwen3-0.6B.jinja": ("qwen3", Phase.BEFORE, Phase.BEFORE, Phase.ANSWER),
    TEMPLATES / "GLM-4.7-Flash.jinja": ("glm45", Phase.OPENED, Phase.OPENED, Phase.ANSWER),
    TEMPLATES / "google-gemma-4-31B-it.jinja": (
        "gemma4",
        Phase.ANSWER,
        Phase.BEFORE,
        Phase.ANSWER,
    ),
    DATA / "exaone4.jinja": ("exaone4", Phase.ANSWER, Phase.OPENED, Phase.ANSWER),
    TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (
        "deepseek_r1",
        Phase.ANSWER,  # llama.cpp's copy closes the block unless enable_thinking is set
        Phase.OPENED,
        Phase.ANSWER,
    ),
    TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": (
        "nemotron_v3",
        Phase.OPENED,
        Phase.OPENED,
        Phase.ANSWER,
    ),
}


@pytest.fixture
def with_template(smollm2_tokenizer):
    original = smollm2_tokenizer.chat_template

    def use(path: Path):
        smollm2_tokenizer.chat_template = path.read_text()
        return smollm2_tokenizer

    yield use
    smollm2_tokenizer.chat_template = original


def _phase(tokenizer, parser, **kwargs) -> Phase:
    prompt = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return parser.phase(prompt)


@pytest.mark.parametrize("path", FAMILIES, ids=[p.stem for p in FAMILIES])
def test_the_template_chooses_the_parser_and_where_the_answer_begins(with_template, path):
    tokenizer = with_template(path)
    name, default, on, off = FAMILIES[path]
    assert parser_name(tokenizer) == name
    parser = PARSERS[name]
    assert _phase(tokenizer, parser) is default
    assert _phase(tokenizer, parser, enable_thinking=True) is on
    assert _phase(tokenizer, parser, enable_thinking=False) is off


def test_a_template_without_markers_gets_no_parser(smollm2_tokenizer):
    assert parser_name(smollm2_tokenizer) == "none"
    assert parser_name(smollm2_tokenizer, "qwen3") == "qwen3"


# (parser, phase, answer, reasoning, content)
ANSWERS = [
    ("qwen3", Phase.BEFORE, "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", "hmm, 2+2", "It is 4."),
    ("qwen3", Phase.BEFORE, "It is 4.", None, "It is 4."),
    ("qwen3", Phase.BEFORE, "  <think>a</think>b", "a", "b"),
    ("qwen3", Phase.BEFORE, "<thinking> is a tag", None, "<thinking> is a tag"),
    ("glm45", Phase.OPENED, "a < b and c\n</think>4", "a < b and c", "4"),
    ("glm45", Phase.OPENED, "<think>again</think>4", "again", "4"),
    ("glm45", Phase.OPENED, "cut in the mid", "cut in the mid", ""),
    ("exaone4", Phase.ANSWER, "</think> stays", None, "</think> stays"),
    ("gemma4", Phase.BEFORE, "<|channel>thought\nhm<channel|>Yes", "hm", "Yes"),
    ("gemma4", Phase.BEFORE, "<|channel>thinking<channel|>Yes", "thinking", "Yes"),
]


@pytest.mark.parametrize(("name", "phase", "answer", "reasoning", "content"), ANSWERS)
def test_an_answer_splits_and_every_streaming_of_it_splits_the_same(
    name, phase, answer, reasoning, content
):
    parser = PARSERS[name]
    parts = split(parser, phase, answer)
    assert (parts.reasoning, parts.content) == (reasoning, content)
    for size in (1, 2, 3, 7):  # deltas of every size: markers and labels cut anywhere
        stream = ReasoningStream(parser, phase)
        pieces = [answer[i : i + size] for i in range(0, len(answer), size)]
        fed = [stream.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(r for r, _ in fed) == (reasoning or "")
        assert "".join(c for _, c in fed) == content
        assert stream.reasoning_chars == parts.reasoning_chars


def test_a_marker_split_across_deltas_is_held_back_whole():
    stream = ReasoningStream(PARSERS["qwen3"], Phase.OPENED)
    assert stream.feed("Paris is sunny</") == ("Paris is sunny", "")
    assert stream.feed("thi") == ("", "")
    assert stream.feed("nk>\n\nIt") == ("", "It")
    assert stream.reasoning_chars == len("Paris is sunny</think>")


def test_tool_calls_in_the_reasoning_are_not_calls():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parts = split(PARSERS["qwen3"], Phase.BEFORE, f"<think>maybe {call}</think>{call}")
    assert parts.reasoning == f"maybe {call}"
    content, calls = TOOL_PARSERS["hermes"]().parse(parts.content)
    assert content.strip() == "" and [c.name for c in calls] == ["f"]


def test_template_arguments_go_only_to_templates_that_read_them(with_template):
    tokenizer = with_template(TEMPLATES / "openai-gpt-oss-120b.jinja")
    given = {"reasoning_effort": ("high", "reasoning_effort")}
    kwargs = template_kwargs(tokenizer, given)
    prompt = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert "Reasoning: high" in prompt
    tokenizer = with_template(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")
    with pytest.raises(InvalidRequestError) as error:
        template_kwargs(tokenizer, given)
    assert error.value.param == "reasoning_effort"
    field = "chat_template_kwargs.tools"  # apply_chat_template's own: not the request's
    with pytest.raises(InvalidRequestError) as error:
        template_kwargs(tokenizer, {"tools": ([], field)})
    assert error.value.param == field


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("phase", "text", "accepted"),
    [
        (Phase.BEFORE, '<think>\n{"no": 1} free</think>\n\n{"city":"Paris"}', True),
        (Phase.BEFORE, '{"city":"Paris"}', True),  # no block: the answer at once
        (Phase.BEFORE, '<think>x</think>{"city":"Rome"}', False),
        (Phase.OPENED, 'free text</think>{"city":"Paris"}', True),
        (Phase.OPENED, '{"city":"Paris"}', False),  # still thinking: the block must end
    ],
)
def test_a_constraint_applies_to_the_answer_after_the_thinking(
    smollm2_tokenizer, phase, text, accepted
):
    thinking = Thinking(PARSERS["qwen3"], phase)
    params = SamplingParams(structured_output=json_schema(SCHEMA, "response_format"))
    params = thinking.sampling_params(params)
    assert _accepts(smollm2_tokenizer, params.structured_output.grammar(), text) is accepted
