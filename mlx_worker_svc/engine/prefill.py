"""Prefill: a request's prompt (or lost KV) computed into its own cache.

`Prefill` works on the `EngineState` it is given: it takes a fresh request's
prefix-cache hit (as `Admission.hit` counted it), rebuilds KV a failed step
lost, and computes prompt tokens into the request's private cache, marking
every request whose KV it writes in the running step's marks (so a failed
step drops that KV, engine/recovery.py). Equally long fresh prompts of one
step prefill together in batched forwards (`admission.prefill_groups`,
`batch.prefill_together`), each ending with its own cache, as a prefill
alone would (up to rounding). A lone request always prefills alone, so a
single stream computes exactly what mlx-lm computes. With quantized KV,
each chunk's float KV is quantized right after it, as mlx-lm's generate does
(engine/cache/quantized.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_worker_svc.core.domain import KVFormat, RequestOutput, TokenLogprobs
from mlx_worker_svc.engine.admission import PREFILL_STEP, Admission, prefill_groups
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import prefill_together
from mlx_worker_svc.engine.sampling import prompt_logprobs
from mlx_worker_svc.engine.sequence import Sequence
from mlx_worker_svc.engine.state import EngineState


class Prefill:
    """Computes requests' prompt KV over one runner's state and model."""

    def __init__(
        self, state: EngineState, model: nn.Module, admission: Admission, kv: KVFormat
    ) -> None:
        self.state = state
        self.model = model
        self.admission = admission  # its prefix-cache hits and batch_prefill
        self.kv = kv  # how requests' KV is stored

    def _scope(self, adapters: list[str]) -> AbstractContextManager[bool]:
        """A forward's construction for rows of these adapters (engine/lora)."""
        held = self.state.adapters
        return held.rows(adapters) if held is not None else nullcontext(False)

    def ready_kv(self, seq: Sequence, output: RequestOutput) -> None:
        """Before a request computes: its prefix-cache hit, or its lost KV rebuilt."""
        prefix = self.state.prefix
        if seq.fresh:
            seq.fresh = False
            hit = self.admission.hit(seq.tokens, seq.params, seq.adapter)
            if hit and prefix is not None:
                taken, cache = prefix.load(seq.tokens, hit, self.state.root(seq.adapter))
                seq.cache, seq.num_computed = cache, taken
                output.num_cached_prompt_tokens = taken
        elif seq.kv_lost:
            target = seq.num_computed
            taken, cache = (0, None)
            if prefix is not None:
                taken, cache = prefix.load(seq.tokens, target, self.state.root(seq.adapter))
            seq.cache, seq.num_computed = cache, taken
            self.prefill(seq, target)
            seq.kv_lost = False

    def prefill_together(self, prefills: list[tuple[Sequence, int, bool]]) -> None:
        """Prefills equally long fresh prompts in batched forwards (admission.prefill_groups).

        Fresh: nothing computed, no cache (no prefix-cache hit), no prompt
        logprobs asked for. Each prompt ends with its own cache, as if
        prefilled alone; `prefill` then finds nothing left to compute.
        """
        state = self.state
        if not self.admission.batch_prefill:
            return
        whole = {
            seq.key: end
            for seq, end, _ in prefills
            if seq.num_computed == 0
            and seq.cache is None
            and seq.key not in state.batch
            and seq.params.prompt_logprobs is None
        }
        for group in prefill_groups(whole):
            tokens = whole[group[0]]
            seqs = [state.seqs[key] for key in group]
            if state.step is not None:
                state.step.touched.update(group)
            scope = self._scope([seq.adapter for seq in seqs])
            caches = prefill_together(self.model, [seq.tokens[:tokens] for seq in seqs], scope)
            for seq, cache in zip(seqs, caches, strict=True):
                seq.cache, seq.num_computed = quantized.quantize(cache, self.kv), tokens

    def prefill(self, seq: Sequence, end: int) -> list[TokenLogprobs]:
        """Computes KV for tokens [num_computed, end) into the request's private cache.

        Returns the prompt logprobs these positions produce, when the request
        asked for them (the logits at position i score prompt token i + 1).
        """
        state = self.state
        if state.step is not None:
            state.step.touched.add(seq.key)
        if seq.key in state.batch:
            seq.cache = state.batch.extract({seq.key})[seq.key]
        if seq.cache is None:
            seq.cache = make_prompt_cache(self.model)
        scored: list[TokenLogprobs] = []
        want = seq.params.prompt_logprobs
        while seq.num_computed < end:
            start, stop = seq.num_computed, min(end, seq.num_computed + PREFILL_STEP)
            chunk = mx.array(seq.tokens[start:stop], dtype=mx.uint32)[None]
            with self._scope([seq.adapter]):
                logits = self.model(chunk, cache=seq.cache)
            # Score prompt tokens once: not again when a preempted request recomputes.
            last = min(stop, seq.prompt_len - 1)
            first = max(start, seq.prompt_scored)
            if want is not None and first < last:
                rows = logits[0, first - start : last - start]
                scored += prompt_logprobs(rows, seq.tokens[first + 1 : last + 1], want)
                seq.prompt_scored = last
            seq.cache = quantized.quantize(seq.cache, self.kv)
            mx.eval([c.state for c in seq.cache])
            seq.num_computed = stop
        return scored
