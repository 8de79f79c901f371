"""The batched decode step: every sampling request's next token from ONE forward.

`Decoder` runs over a runner's `EngineState`: it gathers the requests that
sample into the decode batch (rows it does not schedule step out with their
caches), runs the batch's forward (its look-ahead, batch.DecodeBatch),
samples each row (structured outputs' masks, logprobs from the raw logits),
applies the stopping rules and frees the requests that finished, then queues
the next forward. Runs on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_worker_svc.core.domain import FinishReason, RequestOutput
from mlx_worker_svc.engine import grammar_mask, structured
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.sampling import choose_tokens, token_logprobs
from mlx_worker_svc.engine.sequence import RequestKey, Sequence
from mlx_worker_svc.engine.state import EngineState


class Decoder:
    """One runner's decode steps."""

    def __init__(
        self,
        state: EngineState,
        model: nn.Module,
        grammars: structured.GrammarCompiler,
        options: EngineOptions,
        *,
        kv: Any,
        eos_ids: frozenset[int],
        max_context: int,
        free_all: Callable[[list[RequestKey]], None],
    ) -> None:
        self.state = state
        self.model = model
        self.grammars = grammars
        self.options = options
        self.kv = kv
        self.eos_ids = eos_ids
        self.max_context = max_context
        self._free_all = free_all

    def decode(
        self,
        keys: list[RequestKey],
        outputs: dict[RequestKey, RequestOutput],
        bitmasks: dict[RequestKey, bytes] | None = None,
    ) -> None:
        """One batched forward for `keys` (their last token each), then sampling.

        Rows with a grammar or a scheduler's bitmask sample from the masked
        logits (grammar_mask.py); logprobs stay the raw model's.
        """
        if self.state.step is not None:
            self.state.step.decoding = True
        wanted = set(keys)
        stray = {key for key in self.state.batch.keys if key not in wanted}
        for key, cache in self.state.batch.extract(stray).items():
            self.state.seqs[key].cache = cache
        joining: list[tuple[RequestKey, list[Any]]] = []
        for key in keys:
            if key not in self.state.batch:
                seq = self.state.seqs[key]
                joining.append((key, seq.cache or quantized.empty(self.model, self.kv)))
                seq.cache = None
        self.state.batch.join(joining)
        rows = [self.state.seqs[key] for key in self.state.batch.keys]
        logits = self.state.batch.forward(self.model, [seq.tokens[-1] for seq in rows])
        samplers = [s.sampler for s in rows]
        mask = grammar_mask.step_mask(self.grammars, rows, bitmasks or {})
        greedy = mask is None and all(s.trivial for s in samplers)
        # Launched with the look-ahead's forward (greedy rows, no mask).
        chosen = self.state.batch.choice if mask is None else None
        if chosen is None:
            masked = logits if mask is None else mask.apply(logits)
            chosen = choose_tokens(masked, samplers, [(s.tokens, s.prompt_len) for s in rows])
            mx.async_eval(chosen.arrays())  # type: ignore[no-untyped-call]
        # The next forward is queued before the host waits for this step's
        # tokens: the device never idles while the host reads, answers and
        # waits for the scheduler (batch.DecodeBatch, look-ahead).
        # A row whose next token is surely its last would leave the batch and take
        # the look-ahead's work with it: then `prefetch` starts the next forward
        # for the rows that stay, once they are known.
        if self.options.look_ahead == "speculate" and not any(s.at_last_token() for s in rows):
            self.state.batch.speculate(self.model, chosen.tokens, greedy=greedy)
        tokens, speculated_on = chosen.read()
        self.state.batch.confirm(speculated_on)
        infos = None if greedy else token_logprobs(logits, samplers, tokens)
        complete = grammar_mask.advance(mask, rows, tokens)
        finished: list[RequestKey] = []
        for i, seq in enumerate(rows):
            token = tokens[i]
            seq.num_computed = len(seq.tokens)
            seq.tokens.append(token)
            output = outputs.get(seq.key)
            if output is None:
                output = outputs[seq.key] = RequestOutput(req_id=seq.key[1])
            output.sampled_token_ids.append(token)
            info = infos[i] if infos is not None else None
            if info is not None:
                output.logprobs.append(info)
            reason = self._finish_reason(seq, grammar_complete=i in complete)
            if reason is not None:
                output.finish_reason = reason
                output.num_computed_tokens = seq.num_computed
                output.prompt_tokens, output.completion_tokens = seq.prompt_len, seq.num_output
                finished.append(seq.key)
        self._free_all(finished)
        rows = [self.state.seqs[key] for key in self.state.batch.keys]
        if self.options.look_ahead != "off":
            greedy = all(s.sampler.trivial and s.grammar is None for s in rows)
            self.state.batch.prefetch(self.model, [seq.tokens[-1] for seq in rows], greedy=greedy)

    def _finish_reason(self, seq: Sequence, *, grammar_complete: bool) -> FinishReason | None:
        """The stopping rule the last token fired. A completed grammar decides, even
        before min_tokens: by its EOS or stop token, else GRAMMAR_COMPLETE (which beats
        a length limit)."""
        if not seq.may_finish() and not grammar_complete:
            return None
        reason = seq.finish_reason(
            self.eos_ids, self.max_context, grammar_complete=grammar_complete
        )
        if grammar_complete and reason in (None, FinishReason.LENGTH, FinishReason.CONTEXT_LENGTH):
            return FinishReason.GRAMMAR_COMPLETE
        return reason
