"""The adapter calls on the worker's parts: groups refuse them, sleep keeps them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from lora_adapters import make_adapter
from tiny_model import build_tiny_model

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.errors import FailedPrecondition, ResourceExhausted
from mlx_worker_svc.core.lifecycle import DeviceArgs
from mlx_worker_svc.core.reports import LoadSpec, WorkerState
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.worker.adapters import AdapterCalls
from mlx_worker_svc.worker.core import WorkerCore
from mlx_worker_svc.worker.lifecycle import Lifecycle
from mlx_worker_svc.worker.sleep_drain import SleepAndDrain


@pytest.fixture
def core(tiny_dir: Path) -> Iterator[WorkerCore]:
    core = WorkerCore()
    life = Lifecycle(core)
    life.init_device(DeviceArgs(kind=DeviceKind.CPU))
    life.load_model(LoadSpec(model=str(tiny_dir)))
    yield core
    SleepAndDrain(core).close()


def test_a_worker_group_refuses_adapters(core: WorkerCore, tiny_dir: Path, tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "a", tiny_dir, seed=1)
    channel = core.replica.channel
    channel.size = 2  # as rank 0 of a two-rank group sees itself
    try:
        for call in (
            lambda: AdapterCalls(core).add("a", str(adapter)),
            lambda: AdapterCalls(core).remove("a"),
            lambda: AdapterCalls(core).pin("a", True),
        ):
            with pytest.raises(
                FailedPrecondition, match="a group of 2 ranks, which serves no LoRA"
            ):
                call()
    finally:
        channel.size = 1
    assert AdapterCalls(core).list() == ([], 8)


def test_a_deep_sleep_loads_the_adapters_again(
    core: WorkerCore, tiny_dir: Path, tmp_path: Path
) -> None:
    life = Lifecycle(core)
    calls = AdapterCalls(core)
    calls.add("a", str(make_adapter(tmp_path / "a", tiny_dir, seed=1)))
    calls.pin("a", True)
    life.determine_memory(0.9, 16, 16)
    life.init_cache(64, 16)
    before = calls.list()[0]
    SleepAndDrain(core).sleep(2)
    assert calls.list()[0] == []  # the weights, and the adapters with them, are gone
    assert SleepAndDrain(core).wake_up().dropped_loras == ()
    after = calls.list()[0]
    assert [(a.name, a.path, a.pinned, a.nbytes) for a in after] == [
        (a.name, a.path, a.pinned, a.nbytes) for a in before
    ]


def test_an_adapter_whose_files_went_away_during_a_deep_sleep_is_dropped_at_wake_up(
    core: WorkerCore, tiny_dir: Path, tmp_path: Path
) -> None:
    """WakeUp after a level-2 Sleep loads the adapters again from their paths; one whose
    files are gone is dropped (reported), and the model wakes without it instead of the
    worker staying asleep for good."""
    life = Lifecycle(core)
    calls = AdapterCalls(core)
    calls.add("kept", str(make_adapter(tmp_path / "kept", tiny_dir, seed=1)))
    gone = make_adapter(tmp_path / "gone", tiny_dir, seed=2)
    calls.add("gone", str(gone))
    life.determine_memory(0.9, 16, 16)
    life.init_cache(64, 16)
    SleepAndDrain(core).sleep(2)
    shutil.rmtree(gone)
    woken = SleepAndDrain(core).wake_up()
    assert woken.state is WorkerState.READY and woken.dropped_loras == ("gone",)
    assert [a.name for a in calls.list()[0]] == ["kept"]
    SleepAndDrain(core).sleep(2)  # and the next deep sleep does not try it again
    assert SleepAndDrain(core).wake_up().dropped_loras == ()


def test_serve_with_a_start_adapter_that_does_not_load_exits_1(
    tiny_dir: Path, tmp_path: Path, smollm_dir: Path
) -> None:
    """adapters.md: a --lora-modules path that exists but does not load on the model fails
    auto-init at LoadModel (exit 1), where a missing one is exit 2 before anything."""
    wider = build_tiny_model(tmp_path / "wider", smollm_dir, overrides={"hidden_size": 96})
    other = make_adapter(tmp_path / "other", wider, seed=1)
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--model", str(tiny_dir)]
    command += ["--port", "0", "--auto-init", "--lora-modules", f"x={other}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    said = f"auto-init failed: the worker's --lora-modules adapter 'x' ({other}) does not load"
    assert done.returncode == 1 and said in done.stdout + done.stderr, done


def test_a_start_adapter_that_does_not_fit_a_model_keeps_the_worker_as_it_was(
    tiny_dir: Path, tmp_path: Path, smollm_dir: Path
) -> None:
    """LoadModel of a model the --lora-modules adapters do not fit is FAILED_PRECONDITION
    naming the flag and the adapter (not a client's AddLora), and changes nothing."""
    adapter = make_adapter(tmp_path / "a", tiny_dir, seed=1)
    wider = build_tiny_model(tmp_path / "wider", smollm_dir, overrides={"hidden_size": 96})
    core = WorkerCore(options=EngineOptions(lora_modules=(("a", str(adapter)),)))
    life = Lifecycle(core)
    try:
        life.init_device(DeviceArgs(kind=DeviceKind.CPU))
        _, epoch = life.load_model(LoadSpec(model=str(tiny_dir)))
        with pytest.raises(FailedPrecondition) as refused:
            life.load_model(LoadSpec(model=str(wider)))
        assert refused.value.message.startswith(
            f"the worker's --lora-modules adapter 'a' ({adapter}) does not load on this "
            "model: AddLora: "
        )
        assert core.epoch == epoch and core.load_spec == LoadSpec(model=str(tiny_dir))
        assert [info.name for info in AdapterCalls(core).list()[0]] == ["a"]
    finally:
        SleepAndDrain(core).close()


def test_a_refused_add_holds_none_of_the_adapter_it_measured(
    core: WorkerCore, tiny_dir: Path, tmp_path: Path
) -> None:
    """AddLora loads an adapter to measure it; refused (every slot pinned), the error a
    caller keeps (a gRPC thread, until its next call) holds none of its weights."""
    core.replica.options = replace(core.replica.options, max_loras=1)
    calls = AdapterCalls(core)
    calls.add("a", str(make_adapter(tmp_path / "a", tiny_dir, seed=1)))
    calls.pin("a", True)
    other = make_adapter(tmp_path / "b", tiny_dir, seed=2)
    before = mx.get_active_memory()
    with pytest.raises(ResourceExhausted, match="every one is pinned") as refused:
        calls.add("b", str(other))
    assert refused.value is not None  # kept, as a caller keeps it
    assert mx.get_active_memory() == before
