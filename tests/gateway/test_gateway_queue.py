"""The fleet's queue bound holds on both APIs while no worker is up.

A gateway of `--queue 2` whose one worker never answers: two requests wait for
it, and the next is refused at once with a 429 in the API's own shape. The
Anthropic route tokenizes a chat before the fleet routes it; that wait counts
in the queue as the OpenAI route's does (it did not: every /v1/messages request
waited, unbounded, and /health said none was queued).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import httpx
import pytest
from gateway_process import KEY
from processes import Proc

HEADERS = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
CHAT = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/messages": {"model": "model", "max_tokens": 4, "messages": CHAT},
    "/v1/chat/completions": {"model": "model", "max_tokens": 4, "messages": CHAT},
}


def _wait(url: str, body: dict[str, object]) -> None:
    """Waits for a worker that never comes; the gateway is stopped under it."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, headers=HEADERS, timeout=60)


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("route", list(BODIES))
def test_a_full_queue_is_a_429_while_no_worker_is_up(route: str) -> None:
    gateway = Proc(
        ["gateway", "--worker", f"127.0.0.1:{_unused_port()}", "--port", "0", "--queue", "2"]
    )
    try:
        port = gateway.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1)
        url = f"http://127.0.0.1:{port}"
        waiting = [
            threading.Thread(target=_wait, args=(url + route, BODIES[route]), daemon=True)
            for _ in range(2)
        ]
        for thread in waiting:
            thread.start()
        with httpx.Client(base_url=url, headers=HEADERS, timeout=20) as http:
            deadline = time.monotonic() + 20
            while http.get("/health").json().get("queued") != 2:
                assert time.monotonic() < deadline, http.get("/health").text
                time.sleep(0.05)
            for other, body in BODIES.items():  # the queue is the fleet's: both APIs
                started = time.monotonic()
                refused = http.post(other, json=body)
                assert refused.status_code == 429, refused.text
                assert time.monotonic() - started < 5  # at once, not after the 30 s wait
                assert refused.headers["retry-after"] == "1"
                error = refused.json()["error"]
                assert error["type"] == "rate_limit_error"
                assert "the fleet's queue is full (2 requests waiting)" in error["message"]
            metrics = http.get("/metrics").text
            assert 'mlx_fleet_requests_total{outcome="resource_exhausted"} 2.0' in metrics
            assert "_created" not in metrics  # operations.md lists every series: none of these
    finally:
        gateway.reap()


def _waiting_gateway(*options: str) -> tuple[Proc, str]:
    gateway = Proc(["gateway", "--worker", f"127.0.0.1:{_unused_port()}", "--port", "0", *options])
    port = gateway.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1)
    return gateway, f"http://127.0.0.1:{port}"


def _queued(url: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while httpx.get(url + "/health", headers=HEADERS).json().get("queued") != count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_message_that_waits_ends_and_the_gateway_drains() -> None:
    """A /v1/messages request waiting for a worker when the drain's grace runs out gets
    its 503 and the gateway exits (the error, raised from itself, once sent its queue
    place's bookkeeping round its cause chain for ever: no answer, no exit)."""
    gateway, url = _waiting_gateway("--queue", "2", "--grace-seconds", "3")
    try:
        answers: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: answers.append(
                httpx.post(url + "/v1/messages", json=BODIES["/v1/messages"], headers=HEADERS)
            ),
            daemon=True,
        )
        waiting.start()
        _queued(url, 1)
        gateway.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health", headers=HEADERS).json()["status"] != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A new request meanwhile, count_tokens too, is refused at once, not held.
        body = {k: v for k, v in BODIES["/v1/messages"].items() if k != "max_tokens"}
        counted = httpx.post(url + "/v1/messages/count_tokens", json=body, headers=HEADERS)
        assert counted.status_code == 503, counted.text
        assert "the fleet is shutting down" in counted.json()["error"]["message"]
        assert gateway.proc.wait(timeout=20) == 0, gateway.output
        waiting.join(timeout=10)
        [answer] = answers
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "overloaded_error"
    finally:
        gateway.reap()


def test_a_message_whose_client_left_frees_its_place_in_the_queue() -> None:
    gateway, url = _waiting_gateway("--queue", "2")
    try:
        for _ in range(2):  # each gives up after half a second, while it waits
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(
                    url + "/v1/messages",
                    json=BODIES["/v1/messages"],
                    headers=HEADERS,
                    timeout=0.5,
                )
        _queued(url, 0)
        text = httpx.get(url + "/metrics", headers=HEADERS).text
        assert 'mlx_fleet_requests_total{outcome="cancelled"} 2.0' in text
    finally:
        gateway.reap()
