"""The fleet tests' workers and fleets: one session-wide pool, fleets per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import Fleet, Proc, WorkerPool
from tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def fleet_model(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """The tiny model with a 2,048-token context (a 512-token prefix fits)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("fleet") / "model", smollm_dir, max_position_embeddings=2048
    )


@pytest.fixture(scope="session")
def pool_all(fleet_model: Path) -> Iterator[WorkerPool]:
    pool = WorkerPool(fleet_model)
    try:
        pool.start()
        yield pool
    finally:
        pool.reap()


@pytest.fixture
def pool(pool_all: WorkerPool) -> WorkerPool:
    """The session's fleet workers, every one of them alive."""
    pool_all.heal()
    return pool_all


@pytest.fixture
def start_fleet() -> Iterator[Callable[..., Fleet]]:
    """Starts `mlx-worker fleet --worker T ... --port 0 OPTIONS`; waits for every worker up."""
    procs: list[Proc] = []
    fleets: list[Fleet] = []

    def start(targets: list[str], *options: str) -> Fleet:
        workers = [arg for target in targets for arg in ("--worker", target)]
        procs.append(Proc(["fleet", *workers, "--port", "0", *options]))
        fleets.append(Fleet(procs[-1], targets))
        fleets[-1].wait(lambda s: all(w.up for w in s.workers), "every worker up")
        return fleets[-1]

    yield start
    for fleet in fleets:
        fleet.channel.close()
    for proc in procs:
        proc.reap()
