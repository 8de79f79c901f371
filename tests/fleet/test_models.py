"""The fleet's model names and its residency policy, on plain objects (no worker)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mlx_worker_svc.fleet.models import ModelCatalog, model_dir_name, plan_loads


@dataclass
class Link:
    model_name: str
    last_used: float = 0.0
    up: bool = True
    idle: bool = True
    loading: str = ""
    reached: bool = True


CATALOG = ModelCatalog({"a": "/m/a", "b": "/m/b/", "c": "org/c"})


def test_names_come_from_the_catalog_or_the_path() -> None:
    assert CATALOG.name_of("/m/b", "/cache/b") == "b"
    assert CATALOG.name_of("org/c", "/hub/snapshots/123") == "c"
    assert CATALOG.name_of("/x/SmolLM2-135M/", "/x/SmolLM2-135M") == "SmolLM2-135M"
    assert CATALOG.name_of("", "") == ""
    assert CATALOG.path_of("a") == "/m/a" and CATALOG.path_of("SmolLM2-135M") is None
    assert [CATALOG.initial(i) for i in range(4)] == ["/m/a", "/m/b/", "org/c", "/m/a"]
    assert ModelCatalog().initial(0) == "" and model_dir_name("hub/id") == "id"
    with pytest.raises(ValueError, match="a name and a path"):
        ModelCatalog({"a": ""})


def test_a_wanted_model_goes_to_the_least_recently_used_idle_worker() -> None:
    old, recent = Link("a", last_used=1.0), Link("b", last_used=5.0)
    assert plan_loads([recent, old], ["c"], CATALOG) == [(old, "c")]
    # One load per model, and one per worker.
    assert plan_loads([recent, old], ["c", "c"], CATALOG) == [(old, "c")]
    spare = Link("c", last_used=9.0)
    assert plan_loads([recent, old, spare], ["b", "c", "a"], CATALOG) == []
    busy = Link("a", last_used=0.0, idle=False)
    assert plan_loads([busy, recent], ["c"], CATALOG) == [(recent, "c")]


def test_no_load_evicts_a_wanted_model_or_repeats_one() -> None:
    a, b = Link("a", last_used=1.0), Link("b", last_used=2.0)
    assert plan_loads([a, b], ["c", "a"], CATALOG) == [(b, "c")]
    assert plan_loads([a, b], ["a", "b"], CATALOG) == []  # held already
    loading = Link("a", loading="c", up=False, idle=False)
    assert plan_loads([loading, b], ["c"], CATALOG) == []  # under way
    down = Link("c", up=False)
    assert plan_loads([down, b], ["c"], CATALOG) == [(b, "c")]  # its worker is gone
    assert plan_loads([a, b], ["unknown"], CATALOG) == []  # not configured: never loaded
    assert plan_loads([Link("a", idle=False)], ["c"], CATALOG) == []  # waits for an idle one


def test_no_load_before_every_worker_was_reached() -> None:
    """A worker not heard from yet may hold the model wanted: a fleet just started
    does not swap another worker's model away meanwhile."""
    idle, unheard = Link("tool"), Link("", up=False, reached=False)
    assert plan_loads([idle, unheard], ["t"], ModelCatalog({"tool": "/m/tool", "t": "/m/t"})) == []
    unheard.reached = True  # down, or up with another model: now a load may start
    assert plan_loads([idle, unheard], ["t"], ModelCatalog({"tool": "/m/tool", "t": "/m/t"})) == [
        (idle, "t")
    ]
