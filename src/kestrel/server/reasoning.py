"""Reasoning parsers: split a thinking model's answer into its reasoning and its content.

Thinking models open their answer with a block between two markers (`<think>`...`</think>`, Gemma
4's `<|channel>`...`<channel|>`) that clients want apart: chat completions return it as
`reasoning_content` (streamed as its own deltas), the Responses API as a reasoning item, the
Messages API as a thinking block. Each parser is named as vLLM names it (`--reasoning-parser`) and
`choose_reasoning_parser` picks one from the chat template's text when the flag is unset.

Where the answer starts is read from the prompt's end, as the template wrote it: a prompt that
ends with the start marker (DeepSeek-R1, GLM-4.7, Nemotron, EXAONE with `enable_thinking`) has
opened the block, so the answer begins inside it; one that ends with the end marker wrote an empty
block (`enable_thinking: false`) and the answer is all content; otherwise the model may open a
block at the start of its answer (Qwen3, Gemma 4). An answer cut before the end marker is all
reasoning, as vLLM answers.

`ReasoningStream` is the one splitter, fed text deltas (a whole answer is one delta): it holds back
text that may be the beginning of a marker, so that a marker split across tokens never leaks into
either part, and whitespace at the block's edges.

Structured output (`response_format`, tool_choice `required`) constrains the answer after the
thinking, as vLLM does: `after_thinking` gives the grammar a prefix that lets the reasoning run
free up to the end marker.
"""

import dataclasses
import json
import re
from dataclasses import dataclass
from enum import Enum

from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams
from kestrel.server.tools.parsers import suffix_prefix, template_text


class Phase(Enum):
    BEFORE = "before"  # the model may open a block first
    OPENED = "opened"  # the prompt opened the block: the answer starts inside it
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningParser:
    """A family's markers; `label` opens every block and is not reasoning (Gemma 4's
    `thought\\n`)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    label: str = ""

    def phase(self, prompt: str) -> Phase:
        """Where an answer to `prompt` (its text, special tokens included) begins."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return Phase.ANSWER
        opened = prompt.rfind(self.start)
        if opened >= 0 and not prompt[opened + len(self.start) :].strip(" \n" + self.label):
            return Phase.OPENED
        return Phase.BEFORE


PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("qwen3"),
        ReasoningParser("deepseek_r1"),
        ReasoningParser("glm45"),
        ReasoningParser("exaone4"),
        ReasoningParser("nemotron_v3"),
        ReasoningParser("gemma4", "<|channel>", "<channel|>", "thought\n"),
    )
}

# auto: (what all must be in the chat template, parser); the first match wins, none: no parser
DETECT = (
    (("<|channel>", "<channel|>"), "gemma4"),
    (("[|assistant|]", "</think>"), "exaone4"),
    (("[gMASK]", "</think>"), "glm45"),
    (("<｜Assistant｜>", "</think>"), "deepseek_r1"),
    (("truncate_history_thinking", "</think>"), "nemotron_v3"),
    (("<SPECIAL_11>", "</think>"), "nemotron_v3"),
    (("</think>",), "qwen3"),
)
NAMES = ("auto", "none", *PARSERS)


def parser_name(tokenizer, name: str = "auto") -> str:
    """`name`, or (auto) the one the chat template's markers point to; `none` for none."""
    if name != "auto":
        return name
    template = template_text(tokenizer)
    return next((p for needles, p in DETECT if all(n in template for n in needles)), "none")


def choose_reasoning_parser(tokenizer, name: str = "auto") -> ReasoningParser | None:
    return PARSERS.get(parser_name(tokenizer, name))


class ReasoningStream:
    """Text deltas in, (reasoning, content) deltas out; their sums are the whole answer's split."""

    def __init__(self, parser: ReasoningParser, phase: Phase):
        self.parser, self.phase = parser, phase
        self.held = ""  # text not sent yet: a possible marker, label or edge whitespace
        self.opened = phase is Phase.OPENED  # the answer has a block
        self.thought = False  # the block ended: the content's leading space is neither part
        self.reasoning = ""  # all the reasoning sent
        self.fed = 0  # characters fed
        self.ended_at: int | None = None  # characters fed when the block ended

    @property
    def reasoning_chars(self) -> int:
        """How many characters of the answer (markers included) belong to its block."""
        if self.ended_at is not None:
            return self.ended_at
        return self.fed if self.phase in (Phase.OPENED, Phase.THINKING) else 0

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        self.fed += len(delta)
        self.held += delta
        reasoning, content = "", ""
        while self.held:
            step = self._step()
            if step is None:
                break
            reasoning, content = reasoning + step[0], content + step[1]
        if finished:
            rest = self._flush()
            reasoning, content = reasoning + rest[0], content + rest[1]
        return reasoning, content

    def _step(self) -> tuple[str, str] | None:
        """Move on by what `held` allows: (reasoning, content) sent, or None to wait."""
        if self.phase in (Phase.BEFORE, Phase.OPENED):
            return self._head()
        if self.phase is Phase.THINKING:
            return self._thinking()
        if self.thought:  # the space between the block and the content is neither
            self.held = self.held.lstrip()
            if not self.held:
                return None
            self.thought = False
        content, self.held = self.held, ""
        return "", content

    def _head(self) -> tuple[str, str] | None:
        """The answer's start: the block's start marker (and label), or not."""
        start, label = self.parser.start, self.parser.label
        text = self.held.lstrip()
        if text.startswith(start):
            text = text[len(start) :]
        elif start.startswith(text) or not text:  # may still become the marker
            return None
        elif self.phase is Phase.BEFORE:
            self.phase = Phase.ANSWER
            return "", ""
        if label and len(text) < len(label) and label.startswith(text):
            return None
        self.held = text[len(label) :] if label and text.startswith(label) else text
        self.phase, self.opened = Phase.THINKING, True
        self.held = self.held.lstrip()
        return "", ""

    def _thinking(self) -> tuple[str, str] | None:
        end = self.held.find(self.parser.end)
        if end >= 0:
            reasoning, self.held = self.held[:end].rstrip(), self.held[end + len(self.parser.end) :]
            self.phase, self.thought = Phase.ANSWER, True
            self.ended_at = self.fed - len(self.held)
            return self._lead(reasoning), ""
        keep = suffix_prefix(self.held, self.parser.end)
        sendable = self.held[: len(self.held) - keep]
        keep += len(sendable) - len(sendable.rstrip())  # edge whitespace: maybe the last
        if keep == len(self.held):
            return None
        reasoning, self.held = (
            self.held[: len(self.held) - keep],
            self.held[len(self.held) - keep :],
        )
        return self._lead(reasoning), ""

    def _lead(self, reasoning: str) -> str:
        """`reasoning`, sent (the block's leading whitespace is not reasoning)."""
        if not self.reasoning:
            reasoning = reasoning.lstrip()
        self.reasoning += reasoning
        return reasoning

    def _flush(self) -> tuple[str, str]:
        """What is held once the answer ended: cut inside the block, it is all reasoning."""
        held, self.held = self.held, ""
        if self.phase is Phase.THINKING:
            return self._lead(held.rstrip()), ""
        if self.phase is Phase.OPENED:
            text = held.lstrip()
            text = text[len(self.parser.start) :] if text.startswith(self.parser.start) else text
            return self._lead(text.strip()), ""
        return "", (held.lstrip() if self.thought else held)


@dataclass(frozen=True)
class Parts:
    """A whole answer split: `reasoning` None when it has no block; `reasoning_chars`, how much
    of the answer the block took (see ReasoningStream)."""

    reasoning: str | None
    content: str
    reasoning_chars: int = 0


def split(parser: ReasoningParser, phase: Phase, text: str) -> Parts:
    stream = ReasoningStream(parser, phase)
    reasoning, content = stream.feed(text, finished=True)
    return Parts(reasoning if stream.opened else None, content, stream.reasoning_chars)


# -- the request's side: template arguments, special tokens, grammars -------------------------


# apply_chat_template's own arguments: not the request's to set
RESERVED = {
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "chat_template",
    "padding",
    "truncation",
}


def template_kwargs(tokenizer, given: dict[str, tuple], images: bool = False) -> dict:
    """The chat template's extra arguments (name -> (value, request field)), each one the
    template reads: a 400 naming the field else, as an argument the template ignores would
    change nothing, silently."""
    template = template_text(tokenizer)
    for name, (_, field) in given.items():
        if name in RESERVED or not re.search(rf"\b{re.escape(name)}\b", template):
            raise InvalidRequestError(
                f"{field}: this model's chat template takes no {name!r}", param=field
            )
        if images:  # the model's processor builds a prompt with images, from messages only
            raise InvalidRequestError(
                f"{field}: chat template arguments are not supported with images", param=field
            )
    return {name: value for name, (value, _) in given.items()}


def feed(stream: ReasoningStream | None, text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) deltas of a text delta; all content without a parser."""
    return stream.feed(text, finished) if stream is not None else ("", text)


@dataclass
class Thinking:
    """A request's reasoning split: the parser and where its answer begins (None: no parser,
    or the template wrote a closed block, so the answer is all content)."""

    parser: ReasoningParser | None
    phase: Phase = Phase.ANSWER
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # marker -> its token id
    special: bool = False  # a marker is a special token (a plain decode drops it)

    @property
    def on(self) -> bool:
        return self.parser is not None

    def stream(self) -> ReasoningStream | None:
        return ReasoningStream(self.parser, self.phase) if self.on else None

    def split(self, text: str) -> Parts:
        return split(self.parser, self.phase, text) if self.on else Parts(None, text)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """Markers that are special tokens stay in the text (the parser reads them); a
        constraint applies after the thinking."""
        if not self.on:
            return params
        if self.special:
            params = dataclasses.replace(params, skip_special_tokens=False)
        constraint = params.structured_output
        if constraint is not None and self.phase is not Phase.ANSWER:
            constraint = dataclasses.replace(constraint, thinking=self.grammar())
            params = dataclasses.replace(params, structured_output=constraint)
        return params

    def grammar(self) -> str:
        """Lark rules of the text before the answer (`start: ... @answer` follows from them)."""
        start, end = (self._literal(m) for m in (self.parser.start, self.parser.end))
        # a text end marker ends the shortest text (lazy); a token one cannot be in a terminal
        lazy = "" if self.parser.end in self.tokens else "[lazy]"
        # a few blank characters may part the block and the answer (more: a model could loop)
        space = "SPACE: /[ \\t\\r\\n]{0,4}/\n"
        rules = f"thinking{lazy}: TEXT {end}\nTEXT: /(?s:.*)/\n{space}"
        if self.phase is Phase.BEFORE:
            return f"start: SPACE (thought SPACE)? @answer\nthought: {start} thinking\n{rules}"
        return f"start: thinking SPACE @answer\n{rules}"

    def _literal(self, marker: str) -> str:
        # llguidance matches an added token by its id, not by its text
        return f"<[{self.tokens[marker]}]>" if marker in self.tokens else json.dumps(marker)


def thinking_of(parser: ReasoningParser | None, tokenizer, prompt_ids: list[int]) -> Thinking:
    """The Thinking of an answer to `prompt_ids`."""
    if parser is None:
        return Thinking(None)
    tail = tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    markers = {t.content: (i, t.special) for i, t in added.items()}
    markers = {m: markers[m] for m in (parser.start, parser.end) if m in markers}
    tokens = {m: i for m, (i, _) in markers.items()}
    special = any(s for _, s in markers.values())
    return Thinking(parser, parser.phase(tail), tokens, special)
