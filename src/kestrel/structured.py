"""Structured output: what a request's output must match (a JSON schema, any JSON object, a
regex, one of a list of strings, or a grammar), compiled by llguidance.

This half is plain data and validation, made by the HTTP frontend and carried by SamplingParams
into the engine; kestrel.engine.grammar matches the output token by token and masks the logits.
"""

import json
from dataclasses import dataclass
from typing import Literal

import llguidance
from llguidance import LLMatcher

from kestrel.errors import InvalidRequestError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")

# Compact JSON: with flexible whitespace a small model can emit newlines until max_tokens (the
# loop vLLM users report with xgrammar's any_whitespace); separators stay as json.dumps writes them.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: `spec` is the schema's JSON text (json_schema), a regex, a
    JSON list of strings (choice), a GBNF/EBNF grammar (grammar, llama.cpp's and vLLM's) or
    llguidance's Lark dialect (lark); json_object needs none. `param` names the request field
    it came from, for the 400 when it does not compile. `thinking`: Lark rules of free text the
    constrained answer follows (a reasoning model's thinking, kestrel.server.reasoning), whose
    `start` ends with `@answer`."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"
    thinking: str = ""

    def grammar(self) -> str:
        """The llguidance grammar; InvalidRequestError naming `param` if it cannot be built."""
        try:
            grammar = self._grammar()
        except (ValueError, TypeError, RuntimeError) as error:
            raise self._invalid(str(error)) from None
        return after(self.thinking, grammar) if self.thinking else grammar

    def _grammar(self) -> str:
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choices must be a non-empty list of strings")
        return llguidance.grammar_from(self.kind, self.spec)

    def check(self) -> None:
        """Compile without a tokenizer (the frontend has no model): a 400 for a bad spec before
        the request reaches the engine."""
        error = LLMatcher.validate_grammar(self.grammar())
        if error:
            raise self._invalid(error)

    def _invalid(self, error: str) -> InvalidRequestError:
        what = self.kind.replace("_", " ")
        return InvalidRequestError(
            f"{self.param}: the {what} does not compile: {error.strip()}", param=self.param
        )


def after(lark: str, grammar: str) -> str:
    """`grammar` (Lark text, or llguidance's JSON of a list of grammars) as the subgrammar
    `answer` of the Lark grammar `lark`, which comes first."""
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else None
    if not isinstance(top, dict):
        top = {"grammars": [{"lark_grammar": grammar}]}
    answer, *rest = top["grammars"]
    grammars = [{"lark_grammar": lark}, {**answer, "name": "answer"}, *rest]
    return json.dumps({**top, "grammars": grammars})


def json_schema(schema, param: str) -> StructuredOutput:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(schema, str):
        return StructuredOutput("json_schema", schema, param)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
    return StructuredOutput("json_schema", json.dumps(schema), param)


def choice(choices, param: str) -> StructuredOutput:
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError(f"{param} must be a list of strings", param=param)
    return StructuredOutput("choice", json.dumps(choices), param)
