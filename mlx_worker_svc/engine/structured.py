"""Structured outputs: grammars compiled with llguidance, one per request.

`GrammarCompiler` turns a request's `StructuredOutputs` into an llguidance
matcher for the model's tokenizer. Compiling is thread-safe and cached by
spec (an LRU of compiled matchers; each request gets a cheap copy), so the
worker compiles on the gRPC thread that received the request and the engine
thread only takes the copy. A spec that does not compile, a JSON schema
keyword llguidance cannot honour, or a spec no text matches (found by
computing its first mask) is InvalidArgument naming the field.

llguidance's parser has limits (at most 2,000 Earley items in a row, lexer
states and fuel per step) that a spec may reach only on some token. The
matcher then stops in an error state; `Grammar` turns that into
`GrammarFailed` (INVALID_ARGUMENT naming the request and the field) instead
of letting the error state's EOS-only mask end the request with a text the
spec does not match, and the compiler forgets the spec, whose cached matcher
may share the exhausted state.

`Grammar` is one request's matcher. It follows the request's output tokens
(`sync`), so preemption, resume and a rolled-back step need no bookkeeping.
A step's mask over the batch, and the checks of a step's specs and
scheduler masks, are in grammar_mask.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_worker_svc.core.domain import Origin
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.structured_outputs import (
    StructuredOutputs,
    inexact_number,
    inexact_number_message,
)

RequestKey = tuple[Origin, str]

# Compiled grammars kept per tokenizer (a schema's matcher is a few hundred KB at most).
DEFAULT_CACHE_SIZE = 256
# llguidance's default limits, with short errors: the verbose ones dump the
# parser's state and the grammar into the message a client reads.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarFailed(InvalidArgument):
    """A request's grammar reached one of the engine's limits while it ran (`key`'s)."""

    def __init__(self, key: RequestKey, field_name: str, error: str) -> None:
        self.key = key
        # Without the req_id: what a Generate caller, whose request it is, reads.
        if error.startswith("NoExtensionBias"):  # no token continues the output
            self.detail = (
                f"{field_name}: the output reached a point no text continues under this "
                "spec (a dead end: a required part whose schema or rule only refers to "
                "itself?); fix the spec"
            )
        else:
            self.detail = (
                f"{field_name}: the grammar engine (llguidance) reached one of its limits "
                f"on this spec: {_first_line(error)}; simplify the spec (fewer "
                "alternatives, shorter repetitions)"
            )
        super().__init__(f"req_id {clip(key[1])!r}: {self.detail}")


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "no reason given"


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of a bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@dataclass
class GrammarStats:
    """Counters of a compiler and the masks it filled (read by the benchmark and tests)."""

    compiled: int = 0
    hits: int = 0
    compile_ns: int = 0
    tokenizer_ns: int = 0
    masks: int = 0  # decode steps that filled a mask
    mask_ns: int = 0  # host time filling them


class GrammarCompiler:
    """Compiles StructuredOutputs specs for one tokenizer; safe to call from any thread."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
        capacity: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._ll: dict[bool, llguidance.LLTokenizer] = {}
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self.stats = GrammarStats()
        self._executor: llguidance.LLExecutor | None = None

    @property
    def executor(self) -> llguidance.LLExecutor:
        """Fills the constrained rows of a step in parallel (made on first use)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _tokenizer(self, json: bool) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (about a second).

        JSON grammars get llguidance's JSON "slices" (token-trie partitions that
        make their masks about twice as fast to fill); other grammars the general ones.
        """
        with self._lock:
            if not self._ll:
                start = time.perf_counter_ns()
                general = llguidance.hf.from_tokenizer(
                    self._hf._tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
                self._ll[False] = general
                self._ll[True] = general.with_slices(llguidance.LLTokenizer.json_slices())
                self.stats.tokenizer_ns = time.perf_counter_ns() - start
            return self._ll[json]

    def compile(self, spec: StructuredOutputs, where: str) -> llguidance.LLMatcher:
        """The compiled (never advanced) matcher of `spec`; raises InvalidArgument."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return cached
        tokenizer = self._tokenizer(spec.kind in ("json_schema", "json_object"))
        start = time.perf_counter_ns()
        field_name = f"{where}.{spec.kind}"
        grammar = _grammar_text(spec, field_name)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed or messages:
            # Warnings too: a keyword the engine would ignore is refused, never dropped.
            said = "; ".join(messages).strip()
            raise InvalidArgument(f"{field_name}: {_in_schema_terms(said)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            said = matcher.get_error().strip()
            raise InvalidArgument(f"{field_name}: {_in_schema_terms(said)}")
        self._first_mask(matcher.deep_copy(), field_name)
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_ns += time.perf_counter_ns() - start
            self._cache[spec] = matcher
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return matcher

    def _first_mask(self, matcher: llguidance.LLMatcher, field_name: str) -> None:
        """Refuses a spec whose first mask fails: one no text matches, or past a limit."""
        words = np.zeros((1, mask_words(self.vocab_size)), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
        if not matcher.is_error():
            return
        error = matcher.get_error()
        if error.startswith("NoExtensionBias"):  # llguidance: no token can start the text
            raise InvalidArgument(f"{field_name}: no text matches this spec")
        raise InvalidArgument(f"{field_name}: {_first_line(error)}")

    def forget(self, spec: StructuredOutputs) -> None:
        """Drops `spec`'s compiled matcher (it failed while running): compile it afresh."""
        with self._lock:
            self._cache.pop(spec, None)

    def grammar(
        self, spec: StructuredOutputs, where: str, *, key: RequestKey, start: int
    ) -> Grammar:
        """A fresh matcher for request `key`, whose output begins at token `start`."""
        matcher = self.compile(spec, where).deep_copy()
        return Grammar(
            matcher,
            start,
            key=key,
            field_name=f"{where}.{spec.kind}",
            failed=lambda: self.forget(spec),
        )


_GBNF_ROOT = re.compile(r"^\s*root\s*::=", re.MULTILINE)


def _grammar_text(spec: StructuredOutputs, where: str) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
            if schema.strip() == "true":  # the boolean schema any value matches, as {}
                schema = "{}"
            elif schema.strip() == "false":
                raise InvalidArgument(f"{where} is the schema false: no JSON value matches it")
            _check_exact_numbers(schema, where)
            options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
        if spec.kind == "choice":
            return str(llguidance.grammar_from("choice", json.dumps(list(spec.choices))))
        if spec.kind == "lark_grammar":
            return str(llguidance.grammar_from("lark", spec.text))
        if not _GBNF_ROOT.search(spec.text):  # the engine takes `start ::=` for Lark
            raise InvalidArgument(f"{where}: no 'root' rule (GBNF's start rule: root ::= ...)")
        return str(llguidance.grammar_from("gbnf", spec.text))
    except ValueError as exc:  # not JSON, or GBNF that does not convert
        raise InvalidArgument(f"{where}: {exc}") from exc


# The engine's words for a setting clients cannot reach, in the terms of the schema
# (also inside a longer message: a grammar's %json, a tool's schema).
_ENGINE_WORDS = {
    "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate "
    "oneOf with anyOf": "oneOf is taken only where its branches cannot both match, and "
    "these may: use anyOf"
}


def _in_schema_terms(message: str) -> str:
    for engine, ours in _ENGINE_WORDS.items():
        message = message.replace(engine, ours)
    return message


def _check_exact_numbers(schema: str, where: str) -> None:
    """Refuses an integer past 2^53 in a keyword the output is held to (const, enum,
    bounds): the engine holds JSON numbers as doubles, so it would round the integer
    and produce, or allow, another number than the schema says."""
    try:
        tree = json.loads(schema)
    except ValueError:
        return  # the engine names what does not parse
    if not isinstance(tree, dict):  # the engine says "Expecting object schema to apply options"
        kinds = {list: "an array", str: "a string", bool: "false", type(None): "null"}
        kind = kinds.get(type(tree), "a number")
        raise InvalidArgument(f"{where}: a JSON Schema is an object (or true), got {kind}")
    found = inexact_number(tree)
    if found is not None:
        raise InvalidArgument(f"{where}: {inexact_number_message(*found)}")


class Grammar:
    """One request's grammar state: the matcher and how many output tokens it consumed.

    The output starts at token `start` of the sequence: the prompt's end, or
    earlier for a continuation (NewRequest.num_generated_tokens).
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        start: int,
        *,
        key: RequestKey = (Origin.EXECUTE, ""),
        field_name: str = "sampling_params.structured_outputs",
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self.matcher = matcher
        self.start = start
        self.consumed = 0
        self.key = key
        self.field_name = field_name
        self._failed = failed

    def check(self) -> None:
        """Raises GrammarFailed if the matcher stopped in an error state (a limit)."""
        if self.matcher.is_error():
            self._failed()
            raise GrammarFailed(self.key, self.field_name, self.matcher.get_error())

    def sync(self, tokens: Sequence[int]) -> None:
        """Brings the matcher to the state after the request's output `tokens[start:]`.

        Normally a no-op: `advance` consumed them. After a rolled-back step it
        rolls back; after a continuation's or the scheduler's appended tokens,
        it consumes them.
        """
        output = len(tokens) - self.start
        if self.consumed > output:
            if self.matcher.rollback(self.consumed - output):
                self.consumed = output
            else:
                self.matcher.reset()
                self.consumed = 0
        if self.consumed < output:
            self.matcher.consume_tokens(list(tokens[self.start + self.consumed :]))
            self.consumed = output
        self.check()

    def accepts(self, tokens: Sequence[int]) -> bool:
        """Whether the grammar allows `tokens` next (does not advance it)."""
        return int(self.matcher.validate_tokens(list(tokens))) == len(tokens)

    def advance(self, token: int) -> bool:
        """Consumes a sampled token; returns whether the grammar allows nothing more."""
        if not self.matcher.consume_token(token):  # the mask allowed it: a limit refused it
            self._failed()
            raise GrammarFailed(self.key, self.field_name, self.matcher.get_error())
        self.consumed += 1
        return bool(self.matcher.is_stopped())
