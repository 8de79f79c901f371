"""Fixtures of the worker-group tests: the module-wide group, the single worker, groups to break."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from driver import live_server
from engine.group.ranks import Group, Single
from tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def single(tiny_dir: Path) -> Iterator[Single]:
    with live_server() as (server, stub):
        yield Single(server, stub, tiny_dir)


@pytest.fixture(scope="module")
def group(tiny_dir: Path) -> Iterator[Group]:
    started = Group(tiny_dir)
    try:
        yield started
    finally:
        started.reap()


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A tiny llama whose 6 / 3 heads do not divide by 2: split into a pipeline."""
    heads = {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}
    return build_tiny_model(
        tmp_path_factory.mktemp("pipeline") / "model", smollm_dir, overrides=heads
    )


@pytest.fixture
def start_group(tiny_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Group]]:
    """Starts groups (ranks started directly) that a test breaks; reaped afterwards."""
    groups: list[Group] = []

    def start(*options: str, model: Path = tiny_dir) -> Group:
        groups.append(Group(model, *options, hostfile=tmp_path / f"hosts{len(groups)}.json"))
        return groups[-1]

    yield start
    for started in groups:
        started.reap()
