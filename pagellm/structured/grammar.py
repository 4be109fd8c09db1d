"""StructuredOutputsParams -> an llguidance grammar (its JSON form), checked against the
tokenizer. llguidance (Microsoft, Rust, no dependencies) was chosen over xgrammar and
outlines-core: it compiles JSON schemas, regexes and Lark grammars lazily (no per-schema
vocabulary precomputation: a new schema costs ~1 ms, not seconds), computes a 49k-token mask in
~50 us, and has what speculation needs built in (validate_tokens to cut proposals, rollback for
rejected ones, masks after a run of draft tokens); xgrammar pulls in triton on Linux."""
from __future__ import annotations

import json
import re

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from pagellm.sampling_params import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A schema, regex, choice or grammar that cannot be compiled. `kind` says which field of
    StructuredOutputsParams was at fault (the server names its own field from it)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"structured_outputs.{kind}: {message}")
        self.kind = kind
        self.detail = message


# Whitespace between JSON tokens: newlines and indentation as models like to write them, but
# at most 24 characters per gap. Unbounded whitespace (llguidance's flexible default) lets a
# model loop on "\n\n\n..." until max_tokens, a failure small models fall into; a schema's
# own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"[\n\t ]{0,24}"}


def _lark_string(s: str) -> str:
    """A Lark string literal matching s exactly."""
    return json.dumps(s)


def _is_gbnf(text: str) -> bool:
    """GBNF (llama.cpp) writes rules as `name ::= ...`; Lark as `name: ...`."""
    return re.search(r"^\s*[A-Za-z][\w-]*\s*::=", text, re.MULTILINE) is not None


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text of params (raises StructuredOutputError for input that
    cannot even be translated)."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise StructuredOutputError(kind, "the schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            lark = "start: " + " | ".join(_lark_string(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        text = params.grammar
        if _is_gbnf(text):
            text = gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)
    except StructuredOutputError:
        raise
    except (ValueError, TypeError, GbnfToLarkError) as e:  # JSONDecodeError is a ValueError
        raise StructuredOutputError(kind, str(e)) from None
    except RecursionError:  # JSON nested past the interpreter's stack
        raise StructuredOutputError(kind, "nested too deeply") from None


def compile_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str:
    """The checked grammar; StructuredOutputError naming the problem otherwise."""
    grammar = grammar_source(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        raise StructuredOutputError(params.kind, " ".join(lines)[:500])
    return grammar
