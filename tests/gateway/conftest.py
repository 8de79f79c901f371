"""The gateway tests' processes: one worker on the tiny model, a gateway, an `openai` client.

Each fixture is module-scoped, so a test module starts one worker and one
gateway; a module overrides `worker` (another model) or `gateway` (other flags)
and keeps the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from driver import ServeProcess
from gateway_process import Gateway


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(tiny_dir, 1.0)
    yield proc
    proc.reap()


@pytest.fixture(scope="module")
def gateway(worker: ServeProcess) -> Iterator[Gateway]:
    gw = Gateway(worker.port)
    yield gw
    gw.close()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with gateway.client() as c:
        yield c
