"""The fleet's models: their names, and which idle worker loads a wanted one.

`ModelCatalog` names models: a configured one (`fleet --models NAME=PATH`) by
its name, any other that a worker holds by the last component of its path (the
gateway's model id). `plan_loads` is the residency policy: a configured model
that requests wait for and that no worker holds or is loading is loaded on the
worker that is up, idle (nothing runs or waits on it, no load under way) and
used least recently, among those whose own model no request waits for; that
worker's model is evicted (Sleep level 2, then LoadModel, DetermineMemory,
InitCache and WarmUp: fleet/bring_up.py). One load per model at a time; while
every worker is busy the requests wait, in the fleet's queue, for one to fall
idle. A worker holds one model (`serve --max-loaded-models` is 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar


def model_dir_name(path: str) -> str:
    """The last component of a model path or hub id: "/m/SmolLM2-135M/" -> "SmolLM2-135M"."""
    return path.rstrip("/").rsplit("/", 1)[-1]


class ModelCatalog:
    """The configured models (name -> path, in order) and the names of the others."""

    def __init__(self, configured: Mapping[str, str] | None = None) -> None:
        self.configured = dict(configured or {})
        for name, path in self.configured.items():
            if not name or not path:
                raise ValueError(f"a model needs a name and a path, got {name!r}={path!r}")

    def name_of(self, *paths: str) -> str:
        """The name of the model a worker holds, from the paths it reports ("" for none)."""
        given = [p.rstrip("/") for p in paths if p]
        for name, path in self.configured.items():
            if path.rstrip("/") in given:
                return name
        return model_dir_name(given[0]) if given else ""

    def path_of(self, name: str) -> str | None:
        """The path to load for a configured model; None for any other name."""
        return self.configured.get(name)

    def initial(self, index: int) -> str:
        """The path the index-th worker loads when it has none: the models in turn."""
        paths = list(self.configured.values())
        return paths[index % len(paths)] if paths else ""

    def after(self, path: str) -> str:
        """The configured path after `path`, in turn (`path` itself if not configured)."""
        paths = list(self.configured.values())
        return paths[(paths.index(path) + 1) % len(paths)] if path in paths else path


class Holder(Protocol):
    """What the policy reads of a worker link."""

    @property
    def model_name(self) -> str: ...
    @property
    def loading(self) -> str: ...
    @property
    def up(self) -> bool: ...
    @property
    def idle(self) -> bool: ...
    @property
    def last_used(self) -> float: ...
    @property
    def reached(self) -> bool: ...


H = TypeVar("H", bound=Holder)


def plan_loads(
    links: Iterable[H], wanted: Iterable[str], catalog: ModelCatalog
) -> list[tuple[H, str]]:
    """The loads to start now: (worker, model name), for `wanted` models in order.

    `wanted` are the models requests wait for (each once, oldest first). None
    before every worker was reached once: one not heard from yet may hold a
    model wanted (a fleet just started must not swap another worker's away).
    """
    links = list(links)
    if not all(link.reached for link in links):
        return []
    wanted = list(dict.fromkeys(wanted))
    held = {link.loading or link.model_name for link in links if link.up or link.loading}
    spare = sorted(
        (link for link in links if link.up and link.idle and link.model_name not in wanted),
        key=lambda link: link.last_used,
    )
    loads: list[tuple[H, str]] = []
    for model in wanted:
        if model in held or catalog.path_of(model) is None:
            continue
        if not spare:
            break
        loads.append((spare.pop(0), model))
    return loads
