"""The model runner: one model, its `EngineState`, and running one validated step.

`ModelRunner` composes the parts that share one `EngineState` (engine/state.py):
`Admission` validates a step without changing any request (`plan`), `Prefill`
computes prompt KV, `KVRelease` (engine/release.py) decides where a leaving
request's KV goes, and `run` applies a step all or nothing under a
`StepJournal` (engine/recovery.py): removals, additions, private prefill
chunks, then ONE batched forward for every request that samples in this step
(and, with `num_decode_steps`, further decode steps without a round trip).
Requests from Generate (Origin.GENERATE) live beside Execute's in their own id
space and are scheduled by `internal_work()`, so both kinds share the same
forward passes. Every call runs on the engine thread, except the read-only
views (`kv_usage`, `count`), which copy what they read.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Sequence_
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import mlx.core as mx

from mlx_worker_svc.core.domain import (
    CacheConfig,
    KVUsage,
    MemoryProfile,
    Origin,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepTimings,
)
from mlx_worker_svc.core.errors import InvalidArgument, ResourceExhausted
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine import structured, text
from mlx_worker_svc.engine.admission import Admission
from mlx_worker_svc.engine.cache.batch import DecodeBatch, batchable
from mlx_worker_svc.engine.cache.prefix_cache import PrefixCache
from mlx_worker_svc.engine.decode import Decoder
from mlx_worker_svc.engine.lora.registry import check_adapter
from mlx_worker_svc.engine.memory.guard import MemoryGuard
from mlx_worker_svc.engine.memory.kv_budget import KVBudget
from mlx_worker_svc.engine.model.loader import LoadedModel
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.planning import Limits, check_prompt, check_sampling
from mlx_worker_svc.engine.prefill import Prefill
from mlx_worker_svc.engine.recovery import StepJournal
from mlx_worker_svc.engine.release import KVRelease
from mlx_worker_svc.engine.rewrite import decode_step, dequant, fused, grouped_mask, transposed
from mlx_worker_svc.engine.sampling import RequestSampler
from mlx_worker_svc.engine.sequence import NewSequence, RequestKey, Sequence, Work
from mlx_worker_svc.engine.state import EngineState

# How many finished request ids are remembered, so that a scheduler naming a
# request the worker already finished (EOS) in finished_req_ids is not an error.
_REMEMBER_FINISHED = 65536


@dataclass
class StepOutcome:
    outputs: dict[RequestKey, RequestOutput]
    timings: StepTimings


class ModelRunner:
    """Runs validated steps over one loaded model."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: CacheConfig,
        profile: MemoryProfile,
        options: EngineOptions,
    ) -> None:
        self.model = loaded.model
        self.options = options
        cuda = bool(mx.cuda.is_available())
        if options.fused(cuda):
            fused.install(self.model)  # decode steps: sibling projections as one product
        transposed.install(self.model)  # linear layers keep their weight's transposed view
        decode_step.install(self.model)  # a llama's decode step without mlx-lm's views
        grouped_mask.install(self.model)  # gemma2's grouped heads: each row its mask
        dequant.install(self.model, options.dequant_rows(cuda))  # large quantized decode batches
        self.info = loaded.info
        self.limits = Limits(loaded.info.vocab_size, loaded.info.max_context_length)
        self.eos_ids = frozenset(loaded.info.eos_token_ids)
        self.tokenizer = loaded.tokenizer
        self._special_ids = text.special_ids(loaded.tokenizer, self.eos_ids)
        self.adapters = loaded.adapters
        self.adapters.deltas.bind()  # the layers the rewrites above put in place
        self.adapters.in_use = self.adapter_users
        self.state = EngineState(
            budget=KVBudget(config.num_blocks, config.block_size),
            prefix=PrefixCache(config.block_size, config.kv) if config.prefix_caching else None,
            batch=DecodeBatch(
                aligned=options.aligned_decode,
                scope=self._rows,
                dequant_rows=partial(options.kv_dequant_rows, mx.default_device().type == mx.gpu),
            ),
            adapters=self.adapters,
        )
        self.adapters.on_drop = self._drop_adapter_kv
        self.guard = MemoryGuard(profile, config.memory_limit_bytes)
        self.grammars = structured.GrammarCompiler(
            loaded.tokenizer, vocab_size=loaded.info.vocab_size, eos_ids=sorted(self.eos_ids)
        )
        self.admission = Admission(
            self.state,
            self.limits,
            self.guard,
            self.grammars,
            batch_prefill=batchable(self.model, aligned=options.aligned_decode),
        )
        self.kv = config.kv  # how every request's KV is stored
        # Where a leaving request's KV goes.
        self.release = KVRelease(self.state, self.admission.projected)
        self.prefill = Prefill(self.state, self.model, self.admission, config.kv)
        self.decoder = Decoder(
            self.state,
            self.model,
            self.grammars,
            options,
            kv=config.kv,
            eos_ids=self.eos_ids,
            max_context=self.limits.max_context,
            free_all=self._free_all,
        )

    def _rows(self, keys: Sequence_[RequestKey]) -> AbstractContextManager[bool]:
        """A decode forward's construction for these rows' adapters (engine/lora)."""
        seqs = self.state.seqs
        return self.adapters.rows([seqs[key].adapter for key in keys])

    def _drop_adapter_kv(self, root: int) -> None:
        """An adapter is gone: its prefix-cache blocks go too."""
        if self.state.prefix is not None:
            self.state.prefix.drop_root(root)

    def adapter_users(self) -> Counter[str]:
        """Live requests per adapter (ListLoras; RemoveLora and eviction refuse adapters in use)."""
        return Counter(seq.adapter for seq in list(self.state.seqs.values()) if seq.adapter)

    def detach(self) -> None:
        """Unhooks the runner from its model's adapters once another runner, or none (asleep),
        takes its place: their callbacks would otherwise keep it, and its KV, alive. Its KV
        (requests' and prefix cache's) goes now: the runner is in reference cycles, so the
        garbage collector would free it only at some later collection. The requests' ids
        stay (`state.seqs`, `recently_finished`) for the worker to remember them."""
        if self.adapters.in_use == self.adapter_users:
            self.adapters.in_use = Counter
        if self.adapters.on_drop == self._drop_adapter_kv:
            self.adapters.on_drop = lambda _root: None
        state = self.state
        if state.prefix is not None:
            state.prefix.clear()
        state.batch.clear()
        for seq in state.seqs.values():
            seq.cache = None

    # ------------------------------------------------------------ admission
    def plan(self, plan: StepPlan) -> Work:
        """Validates a scheduler step (Admission.plan)."""
        return self.admission.plan(plan)

    def check_memory(self, work: Work, what: str) -> None:
        """Refuses `work` if its largest forward would not fit (Admission.check_memory)."""
        self.admission.check_memory(work, what)

    def internal_work(self, prefill_chunk: int, base: Work | None = None) -> tuple[Work, bool]:
        """The Generate requests that fit beside `base` (Admission.internal_work)."""
        return self.admission.internal_work(prefill_chunk, base)

    # ----------------------------------------------------------------- views
    def kv_usage(self) -> KVUsage:
        state = self.state
        return KVUsage(
            num_blocks=state.budget.num_blocks,
            used_blocks=state.request_blocks(),
            block_size=state.budget.block_size,
            prefix_cache_blocks=len(state.prefix) if state.prefix is not None else 0,
            kv=self.kv,
        )

    def kv_nbytes(self, key: RequestKey) -> int:
        """Bytes a request's KV buffers take (its share of the batch when batched)."""
        seq = self.state.seqs.get(key)
        if seq is None:
            return 0
        if seq.cache is not None:
            return sum(int(layer.nbytes) for layer in seq.cache)
        return self.state.batch.nbytes // len(self.state.batch) if key in self.state.batch else 0

    def count(self, origin: Origin | None = None) -> tuple[int, int]:
        """(running, preempted) requests, optionally of one origin."""
        running = preempted = 0
        for key, seq in list(self.state.seqs.items()):  # a copy: read off the engine thread too
            if origin is not None and key[0] is not origin:
                continue
            if seq.preempted:
                preempted += 1
            else:
                running += 1
        return running, preempted

    def has(self, origin: Origin) -> bool:
        return any(key[0] is origin for key in self.state.seqs)

    def add_generate(
        self,
        req_id: str,
        prompt: tuple[int, ...],
        params: SamplingParams,
        adapter: str = "",
        prompt_field: str = "prompt",
    ) -> None:
        """Registers a Generate request (of `adapter`); the engine schedules it from now on.

        `prompt_field` names the request's field the prompt came from, in errors.
        """
        key = (Origin.GENERATE, req_id)
        if key in self.state.seqs:
            raise InvalidArgument(f"request_id {clip(req_id)!r} is already running")
        check_adapter(self.adapters, adapter, "GenerateRequest.lora_name")
        check_prompt(prompt, prompt_field, self.limits)
        check_sampling(params, "sampling_params", self.limits)
        if self.state.budget.blocks_for(len(prompt) + 1) > self.state.budget.num_blocks:
            raise ResourceExhausted(
                f"the prompt ({len(prompt)} tokens) does not fit the KV budget of "
                f"{self.state.budget.num_blocks} blocks of {self.state.budget.block_size} tokens"
            )
        self.state.seqs[key] = self._new_sequence(NewSequence(key, prompt, params, adapter=adapter))

    # ------------------------------------------------------------- mutation
    def _new_sequence(self, new: NewSequence) -> Sequence:
        params, prompt = new.params, new.prompt
        sampler = RequestSampler(
            params,
            eos_ids=self.eos_ids,
            vocab_size=self.limits.vocab_size,
            sampled_before=new.generated,
            hold_stops=params.structured_outputs is None,  # else the grammar's mask does
        )
        limit = self.limits.max_context
        seq = Sequence.start(
            new.key, prompt, params, sampler, max_context=limit, adapter=new.adapter
        )
        self.adapters.touch(new.adapter)
        if params.structured_outputs is not None:  # compiled already: a copy from the cache
            seq.grammar = self.grammars.grammar(
                params.structured_outputs,
                "sampling_params.structured_outputs",
                key=new.key,
                start=len(prompt) - new.generated,
            )
        if new.skip_special_tokens is not None:
            seq.text = self.text_stream(skip_special_tokens=new.skip_special_tokens)
            # Output streamed elsewhere already: its text is not repeated (NewRequest.detokenize).
            seq.text.take(prompt[len(prompt) - new.generated :])
        return seq

    def text_stream(self, *, skip_special_tokens: bool) -> text.TextStream:
        """A request's incremental detokenizer: special tokens left out, or kept."""
        skip = self._special_ids if skip_special_tokens else frozenset()
        return text.TextStream(self.tokenizer, skip_ids=skip)

    def free(self, key: RequestKey, *, keep_prefix: bool = True) -> None:
        """Forgets a request and frees its KV (no error if it is unknown).

        With `keep_prefix`, its whole blocks go to the prefix cache first.
        """
        seq = self.state.seqs.pop(key, None)
        if seq is None:
            return
        self.release.release(seq, keep_prefix)
        if self.state.step is not None:
            self.state.step.freed.append(key)
        self._remember_finished(key)

    def remember_finished(self, keys: Iterable[RequestKey]) -> None:
        """Takes `keys` (another runner's freed lately) as freed lately here."""
        for key in keys:
            self._remember_finished(key)

    def _remember_finished(self, key: RequestKey) -> None:
        """Naming `key` in finished_req_ids is no error for a while (the last 65,536)."""
        self.state.recently_finished[key] = None
        while len(self.state.recently_finished) > _REMEMBER_FINISHED:
            self.state.recently_finished.popitem(last=False)

    def _free_all(self, keys: list[RequestKey]) -> None:
        """Frees requests; their batch rows leave in one go (one filter of the batch)."""
        rows = {key for key in keys if key in self.state.batch}
        if len(rows) > 1:
            if self.state.prefix is None:
                self.state.batch.remove(rows)
            else:
                for key, cache in self.state.batch.extract(rows).items():
                    self.state.seqs[key].cache = cache
        for key in keys:
            self.free(key)

    def run(self, work: Work) -> StepOutcome:
        """Applies a validated step and computes it, all or nothing.

        If anything fails (an allocation, say), every request is put back as
        it was before the step; KV the failed step may have touched is dropped
        and rebuilt from the request's tokens the next time it computes.
        """
        journal = StepJournal.begin(self.state, work)
        try:
            return self._apply(work)
        except BaseException as exc:
            journal.roll_back(self.state)
            if isinstance(exc, structured.GrammarFailed) and exc.key not in self.state.seqs:
                # New in the failed step, so never held: the scheduler finishes it (as
                # worker.proto says) without the step being refused for an unknown id.
                self._remember_finished(exc.key)
            raise
        finally:
            self.state.step = None
            self.state.reserved = {}

    def _apply(self, work: Work) -> StepOutcome:
        start = time.perf_counter_ns()
        self.release.reserve(work)
        self._free_all(work.finished)
        for key in work.preempted:
            self.release.preempt(self.state.seqs[key])
        for new in work.new:
            self.state.seqs[new.key] = self._new_sequence(new)
        # Requests whose outputs carry text: their detokenizer and the tokens appended.
        texts: dict[RequestKey, tuple[text.TextStream, tuple[int, ...]]] = {}
        for key, tokens, resumed in work.appends:
            seq = self.state.seqs[key]
            seq.tokens.extend(tokens)
            if resumed:
                seq.preempted, seq.fresh = False, True
            if seq.text is not None:
                texts[key] = (seq.text, tokens)
        outputs = {key: RequestOutput(req_id=key[1]) for key in work.touched}
        forward_start = time.perf_counter_ns()
        sampling: list[RequestKey] = []
        prefills: list[tuple[Sequence, int, bool]] = []
        num_tokens = 0
        for key, count in work.scheduled.items():
            seq = self.state.seqs[key]
            output = outputs.get(key) or outputs.setdefault(key, RequestOutput(req_id=key[1]))
            if seq.text is not None and key not in texts:
                texts[key] = (seq.text, ())
            self.prefill.ready_kv(seq, output)
            end = min(seq.num_computed + count, len(seq.tokens))
            num_tokens += end - seq.num_computed
            samples = end == len(seq.tokens)
            private_end = end - 1 if samples else end
            if private_end > seq.num_computed:
                prefills.append((seq, private_end, samples))
            if samples:
                sampling.append(key)
        self.prefill.prefill_together(prefills)
        for seq, private_end, samples in prefills:
            outputs[seq.key].prompt_logprobs.extend(self.prefill.prefill(seq, private_end))
            if samples and self.state.prefix is not None and seq.cache is not None:
                self.release.to_prefix(seq, seq.cache, self.release.capacity())
        decode_rows = len(sampling)  # the step's batched decode (later steps may hold fewer)
        if sampling:
            self.decoder.decode(sampling, outputs, work.bitmasks)
        for _ in range(work.decode_steps - 1):  # multi-step: no round trip in between
            sampling = [key for key in sampling if key in self.state.seqs]
            if not sampling:
                break
            num_tokens += len(sampling)
            self.decoder.decode(sampling, outputs)
        # A step that computed nothing ran no forward (only its bookkeeping, in total_ns).
        forward_ns = time.perf_counter_ns() - forward_start if num_tokens else 0
        for key, output in outputs.items():
            live = self.state.seqs.get(key)
            if live is not None:
                output.num_computed_tokens = live.num_computed
        # Last, once nothing can fail: a rolled-back step must not have moved a detokenizer.
        for key, (stream, appended) in texts.items():
            _set_text(outputs[key], stream, appended)
        timings = StepTimings(
            total_ns=time.perf_counter_ns() - start,
            forward_ns=forward_ns,
            num_tokens=num_tokens,
            decode_batch_size=decode_rows,
        )
        return StepOutcome(outputs=outputs, timings=timings)

    def abort_all(self, origin: Origin | None = None) -> list[RequestKey]:
        """Frees every request (of one origin); returns their keys."""
        keys = [k for k in self.state.seqs if origin is None or k[0] is origin]
        for key in keys:
            self.free(key, keep_prefix=False)
        return keys

    def reset_prefix_cache(self) -> int:
        """Drops every prefix block; returns how many there were."""
        freed = self.state.prefix.clear() if self.state.prefix is not None else 0
        mx.clear_cache()
        return freed


def _set_text(output: RequestOutput, stream: text.TextStream, appended: tuple[int, ...]) -> None:
    """The text the step's tokens add: the appended ones, then the sampled ones but a stop
    token that ended the request; all held back, once it ends."""
    tokens = (*appended, *output.text_token_ids)
    output.text = stream.take(tokens, last=output.finish_reason is not None)
