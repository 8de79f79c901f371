"""Structured outputs: grammars compiled with llguidance, and the batched logits mask.

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

`StepMask` is one decode step's mask: a [rows, ceil(V / 32)] int32 bitmask
(vLLM's grammar_bitmask layout, bit i of a row = token i allowed) filled on
the host by llguidance for the constrained rows, or copied from the
scheduler's grammar_bitmask, then applied to the whole batch's logits with
one MLX `where`; rows without a constraint are all ones and keep their logits.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_worker_svc.core.domain import Origin, SamplingParams, StepPlan
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.structured_outputs import StructuredOutputs

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
        self.detail = (
            f"{field_name}: the grammar engine (llguidance) reached one of its limits on "
            f"this spec: {_first_line(error)}; simplify the spec (fewer alternatives, "
            "shorter repetitions)"
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
            raise InvalidArgument(f"{field_name}: {'; '.join(messages).strip()}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidArgument(f"{field_name}: {matcher.get_error().strip()}")
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


def _grammar_text(spec: StructuredOutputs, where: str) -> str:
    """llguidance's grammar for `spec` (not yet checked)."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
            if schema.strip() == "true":  # the boolean schema any value matches, as {}
                schema = "{}"
            elif schema.strip() == "false":
                raise InvalidArgument(f"{where} is the schema false: no JSON value matches it")
            options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
        if spec.kind == "choice":
            return str(llguidance.grammar_from("choice", json.dumps(list(spec.choices))))
        if spec.kind == "lark_grammar":
            return str(llguidance.grammar_from("lark", spec.text))
        return str(llguidance.grammar_from("gbnf", spec.text))
    except ValueError as exc:  # not JSON, or GBNF that does not convert
        raise InvalidArgument(f"{where}: {exc}") from exc


class MaskedRow(Protocol):
    """What the mask reads of an engine request (sequence.Sequence, which imports us)."""

    key: RequestKey
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    grammar: Grammar | None
    stops: frozenset[int]  # the ids min_tokens masks (stop ids, EOS unless ignored)


class PlannedStep(Protocol):
    """What planning fills in of a validated step (sequence.Work)."""

    scheduled: dict[RequestKey, int]
    bitmasks: dict[RequestKey, bytes]


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


def check_bitmask(
    data: bytes, vocab_size: int, where: str, masked: frozenset[int] = frozenset()
) -> None:
    """Refuses a scheduler's packed mask of the wrong size or with no token allowed,
    `masked` (ids min_tokens holds back this step) left out."""
    expected = mask_words(vocab_size) * 4
    if len(data) != expected:
        raise InvalidArgument(
            f"{where} has {len(data)} bytes; a mask over {vocab_size} tokens is "
            f"ceil({vocab_size} / 32) int32 words = {expected} bytes"
        )
    words = np.frombuffer(data, dtype="<u4").copy()
    tail = vocab_size % 32
    if tail:
        words[-1] &= np.uint32((1 << tail) - 1)
    if not words.any():
        raise InvalidArgument(f"{where} allows no token")
    for token in masked:
        if token < vocab_size:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    if not words.any():
        raise InvalidArgument(
            f"{where} allows only tokens that end the request (EOS or a stop token), which "
            "sampling_params.min_tokens holds back in this step: no token could be sampled"
        )


@dataclass
class StepMask:
    """The allowed tokens of one decode step's rows, as a packed [rows, words] bitmask."""

    words: np.ndarray[Any, np.dtype[np.int32]]
    grammar_rows: list[int] = field(default_factory=list)  # rows whose matcher advances
    fill_ns: int = 0

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` [B, V] with every disallowed token at -inf: one batched `where`."""
        rows, vocab = logits.shape
        packed = mx.array(self.words.view(np.uint32))
        bits = (packed[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        allowed = bits.reshape(rows, -1)[:, :vocab].astype(mx.bool_)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def step_mask(
    compiler: GrammarCompiler,
    rows: Sequence[MaskedRow],
    bitmasks: Mapping[RequestKey, bytes],
) -> StepMask | None:
    """The mask of a decode step's rows (None when no row is constrained).

    A row is constrained by its grammar, or by the scheduler's packed mask in
    `bitmasks` (never both: planning refuses that).
    """
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained and not bitmasks:
        return None
    start = time.perf_counter_ns()
    words = np.full((len(rows), mask_words(compiler.vocab_size)), -1, dtype=np.int32)
    pairs = []
    for i, row in enumerate(rows):
        data = bitmasks.get(row.key)
        if data is not None:
            words[i] = np.frombuffer(data, dtype="<i4")
        if row.grammar is not None:
            row.grammar.sync(row.tokens)
            pairs.append((row.grammar.matcher, i))
    if pairs:
        llguidance.numpy.fill_next_token_bitmask_par(compiler.executor, pairs, words)
        for row in rows:  # a matcher in an error state masks all but EOS
            if row.grammar is not None:
                row.grammar.check()
    elapsed = time.perf_counter_ns() - start
    compiler.stats.masks += 1
    compiler.stats.mask_ns += elapsed
    return StepMask(words, constrained, elapsed)


def advance(mask: StepMask | None, rows: Sequence[MaskedRow], tokens: Sequence[int]) -> set[int]:
    """Feeds each grammar row its sampled token; returns the rows whose grammar completed."""
    done: set[int] = set()
    for i in mask.grammar_rows if mask is not None else ():
        grammar = rows[i].grammar
        assert grammar is not None
        if grammar.advance(tokens[i]):
            done.add(i)
    return done


def plan_structured(
    plan: StepPlan,
    work: PlannedStep,
    seqs: Mapping[RequestKey, MaskedRow],
    samples: Callable[[RequestKey], bool],
    compiler: GrammarCompiler,
) -> None:
    """Validates a step's structured outputs; puts its bitmasks into `work`.

    Compiles (usually: finds in the cache) every new request's spec, checks
    tokens appended to a constrained request against its grammar, and checks
    each grammar_bitmask entry (see ExecuteRequest.grammar_bitmask). Raises
    InvalidArgument before anything changes.
    """
    for i, new in enumerate(plan.new_requests):
        spec = new.sampling.structured_outputs
        if spec is None:
            continue
        where = f"new_requests[{i}] (req_id {new.req_id!r})"
        matcher = compiler.compile(spec, f"{where}.sampling_params.structured_outputs")
        generated = new.prompt_token_ids[len(new.prompt_token_ids) - new.num_generated_tokens :]
        if generated and not Grammar(matcher.deep_copy(), 0).accepts(generated):
            raise InvalidArgument(
                f"{where}.num_generated_tokens: the last {len(generated)} prompt tokens are "
                "not a start its structured_outputs allows"
            )
    for i, cached in enumerate(plan.cached_requests):
        seq = seqs.get((Origin.EXECUTE, cached.req_id))
        if seq is None or seq.grammar is None or not cached.new_token_ids:
            continue
        seq.grammar.sync(seq.tokens)
        if not seq.grammar.accepts(cached.new_token_ids):
            raise InvalidArgument(
                f"cached_requests[{i}] (req_id {cached.req_id!r}).new_token_ids: the "
                "request's structured_outputs does not allow these tokens here"
            )
    params = {new.req_id: new.sampling for new in plan.new_requests}
    appended = {c.req_id: len(c.new_token_ids) for c in plan.cached_requests}
    for req_id, data in plan.grammar_bitmask.items():
        where = f"grammar_bitmask[{req_id!r}]"
        key = (Origin.EXECUTE, req_id)
        if plan.num_decode_steps > 1:
            raise InvalidArgument(
                f"{where}: a mask covers one sampled token, so num_decode_steps must be "
                f"0 or 1 with grammar_bitmask, got {plan.num_decode_steps}"
            )
        if key not in work.scheduled:
            raise InvalidArgument(f"{where}: req_id is not scheduled in this step")
        if not samples(key):
            raise InvalidArgument(f"{where}: the request does not sample in this step")
        held = seqs.get(key)
        sampling = held.params if held is not None else params[req_id]
        if sampling.structured_outputs is not None:
            raise InvalidArgument(
                f"{where}: the request has sampling_params.structured_outputs; send one or "
                "the other"
            )
        # Before min_tokens, the request's EOS and stop tokens cannot be sampled.
        done = len(held.tokens) - held.prompt_len + appended.get(req_id, 0) if held else 0
        stops = held.stops if held is not None else sampling.stop_ids(compiler.eos_ids)
        check_bitmask(
            data, compiler.vocab_size, where, stops if done < sampling.min_tokens else frozenset()
        )
        work.bitmasks[key] = data
