"""A worker back from a hang (same epoch) is taken back only once it frees what it held.

The link frees each request the worker may still hold (its orphans) before it
counts the worker up. NOT_FOUND means the request never arrived: fine. Any
other refusal (UNAVAILABLE from a worker that began to drain while it hung)
means the worker is not usable: it stays down, orphans kept, and /health and
routing never see it up (it was, for about a second, before).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from mlx_worker_svc.client.errors import ClientError
from mlx_worker_svc.fleet import link as link_module
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

EPOCH = 7


def _link(monkeypatch: pytest.MonkeyPatch, refusal: grpc.StatusCode) -> WorkerLink:
    link = WorkerLink(
        "127.0.0.1:1",
        LinkConfig(),
        on_lost=lambda _lost: None,
        on_up=lambda _link: None,
        emit=lambda *_: True,
    )
    link.epoch, link._orphans = EPOCH, ["a#1", "b#1"]

    async def health() -> pb.CheckHealthResponse:
        return pb.CheckHealthResponse(state=pb.WORKER_STATE_SERVING)

    async def drive_up(*_: Any, **__: Any) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(worker_epoch=EPOCH, state=pb.WORKER_STATE_SERVING)

    async def held(*_: Any) -> dict[str, str]:
        return {}

    async def execute(step: pb.ExecuteRequest) -> pb.ExecuteResponse:
        raise ClientError(refusal, f"Execute: refused {list(step.finished_req_ids)}", "Execute")

    monkeypatch.setattr(link._prober, "health", health)
    monkeypatch.setattr(link_module, "drive_up", drive_up)
    monkeypatch.setattr(link_module, "held_adapters", held)
    monkeypatch.setattr(link.client, "execute", execute)
    return link


def _bring_up(monkeypatch: pytest.MonkeyPatch, refusal: grpc.StatusCode) -> WorkerLink:
    async def main() -> WorkerLink:  # the link's channel needs the running loop
        link = _link(monkeypatch, refusal)
        link.outcome = await link._bring_up()  # type: ignore[attr-defined]
        await link.client.close()
        return link

    return asyncio.run(main())


def test_a_worker_that_will_not_free_its_orphans_stays_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = _bring_up(monkeypatch, grpc.StatusCode.UNAVAILABLE)
    assert link.outcome == "down"  # type: ignore[attr-defined]
    assert not link.up and "UNAVAILABLE" in link.last_error
    assert link._orphans == ["a#1", "b#1"]  # freed at the next try


def test_orphans_it_never_got_are_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    link = _bring_up(monkeypatch, grpc.StatusCode.NOT_FOUND)
    assert link.outcome == "up"  # type: ignore[attr-defined]
    assert link.up and link._orphans == []
