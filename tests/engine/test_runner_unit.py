"""The runner's parts driven directly: StepPlans built here, no server, no gRPC.

As a scheduler would, each test builds the steps itself (new requests,
chunks, decodes, finishes, preemptions) and checks the runner's tokens
against mlx-lm's greedy tokens on the tiny model, or its state after a
refused or failed step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from driver import mlx_lm_tokens

from mlx_worker_svc.core.domain import (
    CacheConfig,
    CachedRequest,
    FinishReason,
    MemoryProfile,
    NewRequest,
    Origin,
    RequestOutput,
    SamplingParams,
    StepPlan,
)
from mlx_worker_svc.core.errors import ResourceExhausted
from mlx_worker_svc.core.reports import LoadSpec
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.recovery import StepJournal
from mlx_worker_svc.engine.runner import ModelRunner

MEMORY_LIMIT = 1 << 33
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> loader.LoadedModel:
    return loader.load(LoadSpec(model=str(tiny_dir)))


def runner_for(
    loaded: loader.LoadedModel, *, num_blocks: int = 64, prefix_caching: bool = False
) -> ModelRunner:
    profile = MemoryProfile(
        total_memory_bytes=MEMORY_LIMIT,
        recommended_working_set_bytes=MEMORY_LIMIT,
        weight_bytes=0,
        activation_peak_bytes=0,
        available_kv_bytes=MEMORY_LIMIT,
        bytes_per_block=1,
        block_size=4,
        suggested_num_blocks=num_blocks,
    )
    config = CacheConfig(num_blocks, 4, prefix_caching, MEMORY_LIMIT)
    return ModelRunner(loaded, config, profile, EngineOptions())


class Scheduler:
    """The least a scheduler does: steps in order, each request's computed count known."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(
        self,
        scheduled: dict[str, int],
        new: tuple[NewRequest, ...] = (),
        *,
        finished: tuple[str, ...] = (),
        preempted: tuple[str, ...] = (),
        resumed: tuple[str, ...] = (),
    ) -> dict[str, RequestOutput]:
        self.step_id += 1
        fresh = {r.req_id for r in new}
        cached = tuple(
            CachedRequest(req_id, self.computed[req_id], resumed_from_preemption=req_id in resumed)
            for req_id in scheduled
            if req_id not in fresh
        )
        plan = StepPlan(
            step_id=self.step_id,
            worker_epoch=1,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )
        outcome = self.runner.run(self.runner.plan(plan))
        outputs = {key[1]: out for key, out in outcome.outputs.items()}
        for req_id, out in outputs.items():
            self.computed[req_id] = out.num_computed_tokens
            self.tokens.setdefault(req_id, []).extend(out.sampled_token_ids)
        for req_id in preempted:
            self.computed[req_id] = 0
        return outputs


def test_chunked_prefill_and_a_decode_batch_give_mlx_lm_tokens(
    loaded: loader.LoadedModel, tiny_dir: Path
) -> None:
    long, short = list(range(100, 110)), [7, 8, 9, 10, 11]
    reference = mlx_lm_tokens(tiny_dir, [long, short], 6)
    runner = runner_for(loaded)
    sched = Scheduler(runner)
    # The long prompt in chunks of 4, 4 and 2; the short one samples in step 1.
    out = sched.step({"a": 4}, (NewRequest("a", tuple(long), GREEDY),))
    assert out["a"].sampled_token_ids == [] and out["a"].num_computed_tokens == 4
    out = sched.step({"a": 4, "b": 5}, (NewRequest("b", tuple(short), GREEDY),))
    assert out["a"].sampled_token_ids == [] and out["a"].num_computed_tokens == 8
    assert len(out["b"].sampled_token_ids) == 1 and out["b"].num_computed_tokens == 5
    out = sched.step({"a": 2, "b": 1})
    assert len(out["a"].sampled_token_ids) == 1
    while runner.state.seqs:
        live = [key[1] for key in runner.state.seqs]
        out = sched.step(dict.fromkeys(live, 1))
        assert len(runner.state.batch) <= 2
    assert sched.tokens["a"] == reference[0]
    assert sched.tokens["b"] == reference[1]
    # Both finished at max_tokens and were freed; naming them again is no error.
    assert out["a"].finish_reason is FinishReason.LENGTH
    assert {(Origin.EXECUTE, "a"), (Origin.EXECUTE, "b")} <= set(runner.state.recently_finished)
    sched.step({}, finished=("a", "b"))


def test_a_preempted_request_resumes_with_the_same_tokens(
    loaded: loader.LoadedModel, tiny_dir: Path
) -> None:
    prompt = [5, 4, 3, 2, 1, 9]
    reference = mlx_lm_tokens(tiny_dir, [prompt], 6)[0]
    runner = runner_for(loaded)
    sched = Scheduler(runner)
    sched.step({"a": 6}, (NewRequest("a", tuple(prompt), GREEDY),))
    sched.step({"a": 1})
    sched.step({}, preempted=("a",))
    seq = runner.state.seqs[(Origin.EXECUTE, "a")]
    assert seq.preempted and seq.cache is None and (Origin.EXECUTE, "a") not in runner.state.batch
    assert runner.kv_usage().used_blocks == 0
    # Resumed: the whole sequence (prompt and its 2 tokens) is computed again.
    sched.step({"a": 8}, resumed=("a",))
    while runner.state.seqs:
        sched.step({"a": 1})
    assert sched.tokens["a"] == reference


def test_admission_refuses_a_step_over_the_kv_budget_and_changes_nothing(
    loaded: loader.LoadedModel,
) -> None:
    runner = runner_for(loaded, num_blocks=3)  # 12 tokens of 4-token blocks
    fits = StepPlan(1, 1, (NewRequest("a", tuple(range(1, 9)), GREEDY),), (), {"a": 8})
    runner.run(runner.plan(fits))
    too_many = StepPlan(2, 1, (NewRequest("b", tuple(range(1, 9)), GREEDY),), (), {"b": 8})
    with pytest.raises(
        ResourceExhausted, match="step 2 needs 4 KV blocks but the budget is 3"
    ) as refused:
        runner.plan(too_many)
    # The message names what the step would add, and for which request: what to preempt.
    assert refused.value.message.endswith("first (it adds 2: 2 for req_id 'b')")
    assert list(runner.state.seqs) == [(Origin.EXECUTE, "a")]
    assert runner.kv_usage().used_blocks == 2


def test_the_journal_undoes_a_failed_step(loaded: loader.LoadedModel, tiny_dir: Path) -> None:
    prompt = [3, 1, 4, 1, 5, 9]
    reference = mlx_lm_tokens(tiny_dir, [prompt], 6)[0]
    runner = runner_for(loaded)
    sched = Scheduler(runner)
    sched.step({"a": 6}, (NewRequest("a", tuple(prompt), GREEDY),))
    key = (Origin.EXECUTE, "a")
    seq = runner.state.seqs[key]
    before = (list(seq.tokens), seq.num_computed)
    work = runner.plan(StepPlan(9, 1, (), (CachedRequest("a", 6),), {"a": 1}))
    journal = StepJournal.begin(runner.state, work)
    assert runner.state.step is journal.marks
    # What a step that fails in its batched forward has done by then.
    runner.state.step.decoding = True
    seq.tokens.append(0)
    seq.num_computed += 1
    journal.roll_back(runner.state)
    runner.state.step = None
    assert (seq.tokens, seq.num_computed) == before
    assert seq.kv_lost and key not in runner.state.batch  # its KV is rebuilt next time
    while runner.state.seqs:
        sched.step({"a": 1})
    assert sched.tokens["a"] == reference


def test_a_failed_run_leaves_every_request_as_it_was(loaded: loader.LoadedModel) -> None:
    runner = runner_for(loaded)
    sched = Scheduler(runner)
    sched.step({"a": 4}, (NewRequest("a", (1, 2, 3, 4), GREEDY),))
    seq = runner.state.seqs[(Origin.EXECUTE, "a")]
    tokens = list(seq.tokens)

    def broken(*_args: object) -> None:
        raise MemoryError("out of memory")

    runner.prefill.prefill = broken  # type: ignore[assignment, method-assign]
    plan = StepPlan(
        2, 1, (NewRequest("b", (5, 6, 7), GREEDY),), (CachedRequest("a", 4),), {"a": 1, "b": 3}
    )
    with pytest.raises(MemoryError):
        runner.run(runner.plan(plan))
    assert list(runner.state.seqs) == [(Origin.EXECUTE, "a")]
    assert seq.tokens == tokens and seq.num_computed == 4
    assert runner.state.step is None and runner.state.reserved == {}


def test_a_prefix_cache_hit_skips_the_cached_blocks(
    loaded: loader.LoadedModel, tiny_dir: Path
) -> None:
    prompt = list(range(20, 33))  # 13 tokens: 3 whole blocks of 4
    reference = mlx_lm_tokens(tiny_dir, [prompt], 6)[0]
    runner = runner_for(loaded, prefix_caching=True)
    sched = Scheduler(runner)
    first = sched.step({"a": 13}, (NewRequest("a", tuple(prompt), GREEDY),))
    assert first["a"].num_cached_prompt_tokens == 0
    assert runner.kv_usage().prefix_cache_blocks == 3
    # The same prompt again: 12 tokens come from the cache, 1 is computed.
    assert runner.admission.hit(prompt, GREEDY) == 12
    again = sched.step({"b": 13}, (NewRequest("b", tuple(prompt), GREEDY),))
    assert again["b"].num_cached_prompt_tokens == 12
    while runner.state.seqs:
        sched.step(dict.fromkeys((key[1] for key in runner.state.seqs), 1))
    assert sched.tokens["a"] == reference
    assert sched.tokens["b"] == reference
