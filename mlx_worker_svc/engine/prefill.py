"""Prefill: a request's prompt (or lost KV) computed into its own cache.

`ModelRunner` inherits these (and, through them, Admission's checks); the
state they use (requests, decode batch, prefix cache, the step's journal) is
the runner's. Equally long fresh prompts of one step prefill together in
batched forwards (`admission.prefill_groups`, `batch.prefill_together`),
each ending with its own cache, as a prefill alone would (up to rounding).
A lone request always prefills alone, so a single stream computes exactly
what mlx-lm computes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_worker_svc.core.domain import RequestOutput, TokenLogprobs
from mlx_worker_svc.engine.admission import PREFILL_STEP, Admission, prefill_groups
from mlx_worker_svc.engine.cache.batch import DecodeBatch, prefill_together
from mlx_worker_svc.engine.recovery import StepJournal
from mlx_worker_svc.engine.sampling import prompt_logprobs
from mlx_worker_svc.engine.sequence import RequestKey, Sequence


class Prefill(Admission):
    model: nn.Module
    batch: DecodeBatch[RequestKey]
    _journal: StepJournal | None

    def _ready_kv(self, seq: Sequence, output: RequestOutput) -> None:
        """Before a request computes: its prefix-cache hit, or its lost KV rebuilt."""
        if seq.fresh:
            seq.fresh = False
            hit = self._hit(seq.tokens, seq.params)
            if hit and self.prefix is not None:
                taken, cache = self.prefix.load(seq.tokens, hit)
                seq.cache, seq.num_computed = cache, taken
                output.num_cached_prompt_tokens = taken
        elif seq.kv_lost:
            target = seq.num_computed
            taken, cache = (0, None)
            if self.prefix is not None:
                taken, cache = self.prefix.load(seq.tokens, target)
            seq.cache, seq.num_computed = cache, taken
            self._prefill(seq, target)
            seq.kv_lost = False

    def _prefill_together(self, prefills: list[tuple[Sequence, int, bool]]) -> None:
        """Prefills equally long fresh prompts in batched forwards (admission.prefill_groups).

        Fresh: nothing computed, no cache (no prefix-cache hit), no prompt
        logprobs asked for. Each prompt ends with its own cache, as if
        prefilled alone; `_prefill` then finds nothing left to compute.
        """
        if not self.batch_prefill:
            return
        whole = {
            seq.key: end
            for seq, end, _ in prefills
            if seq.num_computed == 0
            and seq.cache is None
            and seq.key not in self.batch
            and seq.params.prompt_logprobs is None
        }
        for group in prefill_groups(whole):
            tokens = whole[group[0]]
            seqs = [self.seqs[key] for key in group]
            if self._journal is not None:
                self._journal.touched.update(group)
            caches = prefill_together(self.model, [seq.tokens[:tokens] for seq in seqs])
            for seq, cache in zip(seqs, caches, strict=True):
                seq.cache, seq.num_computed = cache, tokens

    def _prefill(self, seq: Sequence, end: int) -> list[TokenLogprobs]:
        """Computes KV for tokens [num_computed, end) into the request's private cache.

        Returns the prompt logprobs these positions produce, when the request
        asked for them (the logits at position i score prompt token i + 1).
        """
        if self._journal is not None:
            self._journal.touched.add(seq.key)
        if seq.key in self.batch:
            seq.cache = self.batch.extract({seq.key})[seq.key]
        if seq.cache is None:
            seq.cache = make_prompt_cache(self.model)
        scored: list[TokenLogprobs] = []
        want = seq.params.prompt_logprobs
        while seq.num_computed < end:
            start, stop = seq.num_computed, min(end, seq.num_computed + PREFILL_STEP)
            chunk = mx.array(seq.tokens[start:stop], dtype=mx.uint32)[None]
            logits = self.model(chunk, cache=seq.cache)
            # Score prompt tokens once: not again when a preempted request recomputes.
            last = min(stop, seq.prompt_len - 1)
            first = max(start, seq.prompt_scored)
            if want is not None and first < last:
                rows = logits[0, first - start : last - start]
                scored += prompt_logprobs(rows, seq.tokens[first + 1 : last + 1], want)
                seq.prompt_scored = last
            mx.eval([c.state for c in seq.cache])
            seq.num_computed = stop
        return scored
