"""The worker's parts driven directly: a core, its lifecycle part and its Generate calls.

No server and no gRPC: each test builds a `WorkerCore` and the parts that
take it, calls them as the servicer would, and checks states, epochs,
errors and tokens (mlx-lm's greedy tokens on the tiny model).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from driver import mlx_lm_tokens

from mlx_worker_svc.core.domain import DeviceKind, SamplingParams
from mlx_worker_svc.core.errors import FailedPrecondition, ResourceExhausted
from mlx_worker_svc.core.generate import GenerateChunk, GenerateSpec
from mlx_worker_svc.core.lifecycle import DeviceArgs
from mlx_worker_svc.core.reports import LoadSpec, WorkerState
from mlx_worker_svc.worker.core import WorkerCore
from mlx_worker_svc.worker.generate import GenerateCalls
from mlx_worker_svc.worker.lifecycle import Lifecycle
from mlx_worker_svc.worker.sleep_drain import SleepAndDrain

S = WorkerState


@pytest.fixture
def core() -> Iterator[WorkerCore]:
    core = WorkerCore()
    yield core
    SleepAndDrain(core).close()


def bring_up(core: WorkerCore, model: Path, *, num_blocks: int = 64) -> Lifecycle:
    life = Lifecycle(core)
    life.init_device(DeviceArgs(kind=DeviceKind.CPU))
    life.load_model(LoadSpec(model=str(model)))
    life.determine_memory(0.9, 64, 4)
    life.init_cache(num_blocks, 4)
    return life


def state(core: WorkerCore) -> WorkerState:
    """The core's state, read afresh (each call may have changed it)."""
    return core.state


def tokens_of(chunks: Iterator[GenerateChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def test_the_lifecycle_parts_move_the_core_through_its_states(
    core: WorkerCore, tiny_dir: Path
) -> None:
    life = Lifecycle(core)
    with pytest.raises(FailedPrecondition, match="the worker is NEW: call InitDevice first"):
        life.load_model(LoadSpec(model=str(tiny_dir)))
    life.init_device(DeviceArgs(kind=DeviceKind.CPU))
    assert state(core) is S.DEVICE_READY
    _, epoch = life.load_model(LoadSpec(model=str(tiny_dir)))
    assert state(core) is S.MODEL_LOADED and core.runner is None
    assert life.load_model(LoadSpec(model=str(tiny_dir)))[1] == epoch  # the same: no work
    with pytest.raises(FailedPrecondition, match="call DetermineMemory first"):
        life.init_cache(16, 4)
    profile = life.determine_memory(0.9, 64, 4)
    assert state(core) is S.MEMORY_PROFILED and profile.block_size == 4
    config = life.init_cache(16, 4)
    assert state(core) is S.READY and core.runner is not None
    assert (config.num_blocks, config.block_size) == (16, 4)
    life.warm_up([1, 2], [8])
    assert state(core) is S.SERVING
    report = SleepAndDrain(core).sleep(1)
    assert state(core) is S.SLEEPING and report.level == 1
    assert core.runner is None and core.loaded is not None  # level 1 keeps the weights
    assert core.epoch != epoch
    woken = SleepAndDrain(core).wake_up()
    assert woken.state is S.SERVING and woken.worker_epoch == core.epoch
    assert core.runner is not None and woken.dropped_loras == ()
    SleepAndDrain(core).close()
    assert state(core) is S.STOPPED and core.runner is None and core.loaded is None


def test_generate_calls_stream_mlx_lm_tokens_without_a_server(
    core: WorkerCore, tiny_dir: Path
) -> None:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    reference = mlx_lm_tokens(tiny_dir, prompts, 8)
    bring_up(core, tiny_dir)
    assert state(core) is S.READY
    calls = GenerateCalls(core)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    started = [
        calls.generate(GenerateSpec(request_id=f"g{i}", prompt_token_ids=tuple(p), sampling=greedy))
        for i, p in enumerate(prompts)
    ]
    assert [tokens_of(chunks) for chunks, _ in started] == reference
    assert not core.streams and core.runner is not None and not core.runner.state.seqs
    assert state(core) is S.SERVING  # a first step, a Generate's as much as an Execute's


def test_the_scheduler_sheds_the_youngest_stream_when_the_kv_budget_is_full(
    core: WorkerCore, tiny_dir: Path
) -> None:
    prompt_a, prompt_b = list(range(40, 48)), list(range(60, 68))
    reference = mlx_lm_tokens(tiny_dir, [prompt_a], 12)[0]
    # 6 blocks of 4 tokens: the two requests cannot both reach 20 tokens.
    bring_up(core, tiny_dir, num_blocks=6)
    calls = GenerateCalls(core)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12)
    first, _ = calls.generate(GenerateSpec("a", prompt_token_ids=tuple(prompt_a), sampling=greedy))
    second, _ = calls.generate(GenerateSpec("b", prompt_token_ids=tuple(prompt_b), sampling=greedy))
    with pytest.raises(ResourceExhausted, match="the KV budget is full"):
        tokens_of(second)
    assert tokens_of(first) == reference
    assert core.runner is not None and not core.runner.state.seqs
