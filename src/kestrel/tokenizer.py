"""Text in and out: transformers' tokenizer and chat template, incremental detokenization, stops."""

from kestrel.errors import InvalidRequestError

# end-of-turn tokens chat models emit instead of (or besides) EOS, as llama.cpp's "EOG" set;
# Gemma 4 ends a turn of tool calls with `<|tool_response>`, where its template puts the results
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<turn|>",
    "<|tool_response>",
)


def stop_token_ids(tokenizer, config) -> set[int]:
    """EOS ids from the config and tokenizer, plus the end-of-turn tokens the vocabulary has."""
    ids = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return ids


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """Token ids of a conversation with the generation prompt appended."""
    if not tokenizer.chat_template:
        raise InvalidRequestError(
            "this model has no chat template; use the completions endpoint", param="messages"
        )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def encode(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt string (BOS added as the tokenizer does) or a list of ids, as token ids."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    return list(prompt)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, never emitting half a multi-byte character.

    Decodes a short window of recent ids (so tokenizers that merge spaces across tokens decode
    right) and holds text back while it ends in U+FFFD, the mark of an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.decode = fast_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=self.skip_special_tokens)


def fast_decode(tokenizer):
    """The Rust tokenizer's decode where transformers' decode only wraps it (no clean-up of
    tokenization spaces): the same text at a third of the cost, twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class StopStringMatcher:
    """Accumulates text, cuts it at the first stop string, and says how much is safe to stream.

    Text that could still be the start of a stop string is held back until it cannot be.
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.stops = stops
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.stopped = False

    def feed(self, delta: str) -> None:
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
            self.stopped = True

    def streamable(self, finished: bool) -> str:
        """The prefix of `text` that no future stop string can remove."""
        if finished or self.stopped or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
