"""Structured output: a request's answer held to a JSON schema, a regex, a choice or a grammar.

A spec (``SamplingParams.structured_outputs``, vLLM's shape: exactly one of ``json``,
``json_object``, ``regex``, ``choice``, ``grammar``) is compiled by llguidance (Microsoft's grammar
engine, in Rust; chosen over xgrammar, which is as fast here but needs transformers, triton and
tvm-ffi at run time: llguidance needs nothing) into a grammar, once per spec (``GrammarCompiler``'s
cache). Each request then has a ``Matcher``: before a token is sampled it gives the tokens the
grammar allows next (a bitmask, one bit per vocabulary entry, ``apply_masks`` turning the others
to -inf: ``engine/sampler.py``), and it takes every token the request gets (``Sequence.append_token``), the first one a
prefill instance sampled included. Once the grammar is complete only EOS is allowed: the answer
ends there. Measured cost: ``python -m bench.structured``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:  # torch only for hints: the Conductor validates specs and never loads torch
    import torch

    from engine.tokenizer import Tokenizer

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHED_GRAMMARS = 256  # compiled specs kept (a grammar is a few KB)
# Compact JSON: whitespace is the one thing a small model can emit for ever inside a valid answer.
_JSON_OPTIONS = {"whitespace_flexible": False}


def check_spec(spec: Any) -> dict[str, Any]:
    """``spec``'s shape checked (exactly one kind, its value's type); raises ValueError."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"structured_outputs must be an object with exactly one of {', '.join(KINDS)}")
    (kind, value), = spec.items()
    ok = {"json": isinstance(value, (dict, str)), "json_object": value is True,
          "regex": isinstance(value, str) and value != "", "grammar": isinstance(value, str) and value != "",
          "choice": isinstance(value, list) and value != [] and all(isinstance(c, str) for c in value)}[kind]
    if not ok:
        want = {"json": "a JSON schema (an object, or its text)", "json_object": "true",
                "regex": "a non-empty string", "grammar": "a non-empty Lark grammar",
                "choice": "a non-empty array of strings"}[kind]
        raise ValueError(f"structured_outputs.{kind} must be {want}")
    return spec


class GrammarCompiler:
    """Compiles specs for one tokenizer. Its llguidance tokenizer is built at the first spec
    (~0.3 s for a 49k vocabulary); thread-safe (the server's parser and the engine thread share it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                t = self._tokenizer
                self._ll = llguidance.LLTokenizer(t.hf.to_str(), n_vocab=t.vocab_size, eos_token=sorted(t.eos_token_ids))
            return self._ll

    def grammar(self, spec: dict[str, Any]) -> str:
        """The compiled grammar of ``spec``, checked; raises ValueError saying what is wrong."""
        key = json.dumps(check_spec(spec), sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = _grammar_of(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if problem:
            raise ValueError(f"structured_outputs.{next(iter(spec))}: {problem.splitlines()[0][:300]}")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, spec: dict[str, Any]) -> Matcher:
        """A new request's matcher for ``spec``; raises ValueError for a spec that does not compile."""
        m = llguidance.LLMatcher(self._ll_tokenizer(), self.grammar(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{next(iter(spec))}: {m.get_error()[:300]}")
        return Matcher(m, self.vocab_size)


def _grammar_of(spec: dict[str, Any]) -> str:
    (kind, value), = spec.items()
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            # A Lark alternation of the choices as JSON string literals (Lark reads their escapes).
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        return llguidance.LLMatcher.grammar_from_lark(value)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._words = (vocab_size + 31) // 32

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        return self._m

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-next bitmask into ``row`` (int32, contiguous, ``(vocab + 31) // 32``)."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)

    def accept(self, token: int) -> None:
        """Take the request's next token. A token the grammar refused (only a request that asked
        for ignore_eos can sample past the end) leaves the matcher in its error state, whose mask
        then allows only EOS."""
        self._m.consume_token(token)
