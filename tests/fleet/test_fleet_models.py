"""Many models on one fleet, end to end: routing per model, failover, loads on demand.

Three tiny random llamas built with different seeds (so each answers with its
own tokens) are served by name (`--models a=... b=... c=...`) from three bare
`serve` workers that the fleets take through their lifecycle. A request's
greedy tokens tell which model answered it; the workers' counts tell where.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from lora_adapters import make_adapter
from processes import Fleet, Proc, Stream, WorkerPool, by_target, distinct_prompts, run_streams
from processes import token_request as greedy
from tiny_model import build_tiny_model

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

PROMPTS = distinct_prompts(6, 24, seed=23)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_model(root / name, smollm_dir, seed=i) for i, name in enumerate("abc")}


@pytest.fixture(scope="module")
def pool(models: dict[str, Path]) -> Iterator[WorkerPool]:
    pool = WorkerPool(models["a"], auto_init=False)
    try:
        pool.start()
        yield pool
    finally:
        pool.reap()


def model_flags(models: dict[str, Path], names: str) -> list[str]:
    return ["--models", *(f"{name}={models[name]}" for name in names)]


def ask(model: str, prompt: list[int], max_tokens: int = 8) -> pb.GenerateRequest:
    request = greedy(prompt, max_tokens)
    request.model = model
    return request


def start(pool: WorkerPool, indexes: list[int], *options: str) -> Fleet:
    targets = [pool.targets[i] for i in indexes]
    args = [arg for target in targets for arg in ("--worker", target)]
    fleet = Fleet(Proc(["fleet", *args, "--port", "0", *options]), targets)
    try:
        fleet.wait(lambda s: all(w.up for w in s.workers), "every worker up", timeout=120)
    except BaseException:
        close(fleet)  # a fleet that never came up is not left running
        raise
    return fleet


def close(fleet: Fleet) -> None:
    fleet.channel.close()
    fleet.proc.reap()


def tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def test_each_model_is_served_only_by_its_workers_and_fails_over_to_them(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    fleet = start(pool, [0, 1, 2], *model_flags(models, "ab"))
    try:
        status = fleet.status()
        # Workers that hold no model load the configured ones in turn.
        held = {w.target: w.model_name for w in status.workers}
        a_workers = sorted(t for t, name in held.items() if name == "a")
        [b_worker] = [t for t, name in held.items() if name == "b"]
        assert len(a_workers) == 2
        assert [(m.name, sorted(m.workers), m.configured) for m in status.models] == [
            ("a", a_workers, True),
            ("b", [b_worker], True),
        ]
        reference = {m: tokens(fleet.generate(ask(m, PROMPTS[0]))) for m in "ab"}
        assert reference["a"] != reference["b"]  # the tokens tell the models apart

        # Errors name the model: unknown is NOT_FOUND, none with two models INVALID_ARGUMENT.
        with pytest.raises(grpc.RpcError) as unknown:
            fleet.generate(ask("gpt-4", PROMPTS[0]))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'gpt-4'" in str(unknown.value.details())
        with pytest.raises(grpc.RpcError) as unnamed:
            fleet.generate(ask("", PROMPTS[0]))
        assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'a', 'b'" in str(unnamed.value.details())

        # Requests for each land only on workers of their model.
        before = by_target(fleet.status())
        streams = run_streams(fleet.stub, [ask(m, PROMPTS[0]) for m in "abababab"])
        assert [s.error for s in streams] == [None] * 8
        assert [s.tokens for s in streams] == [reference[m] for m in "abababab"]
        after = by_target(fleet.status())
        done = {t: after[t].num_finished - before[t].num_finished for t in after}
        assert done[b_worker] == 4 and sum(done[t] for t in a_workers) == 4

        # A worker of `a` dies mid-answer: its requests finish on the other one.
        long = [ask("a", p, max_tokens=160) for p in PROMPTS[1:5]]
        reference_long = [tokens(fleet.generate(r)) for r in long]
        victim = a_workers[0]
        before = by_target(fleet.status())
        streams = run_streams_killing(fleet, pool, long, victim)
        assert [s.error for s in streams] == [None] * 4
        assert [s.tokens for s in streams] == reference_long
        after = by_target(fleet.status())
        assert after[victim].num_failed_over > before[victim].num_failed_over
        assert after[b_worker].num_finished == before[b_worker].num_finished
    finally:
        close(fleet)
        pool.heal()


def run_streams_killing(
    fleet: Fleet, pool: WorkerPool, requests: list[pb.GenerateRequest], victim: str
) -> list[Stream]:
    """Streams the requests; kills `victim` once it runs some and every stream has tokens."""
    streams = [Stream(fleet.stub, request) for request in requests]
    for stream in streams:
        stream.start()
    fleet.wait(lambda s: by_target(s)[victim].num_running > 0, "requests on the victim")
    for stream in streams:
        stream.first_token.wait(timeout=60)
    pool.kill(pool.targets.index(victim))
    for stream in streams:
        stream.join(timeout=300)
    return streams


def test_the_gateway_lists_every_model_and_routes_by_name(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    args = [arg for target in pool.targets for arg in ("--worker", target)]
    # An adapter of model b, named with its base as vLLM's JSON form does.
    adapter = make_adapter(models["b"].parent / "adapter-b", models["b"], seed=5)
    spec = json.dumps({"name": "ad", "path": str(adapter), "base_model_name": "b"})
    lora = ["--lora-modules", spec]
    proc = Proc(["gateway", *args, "--port", "0", *model_flags(models, "ab"), *lora])
    port = int(proc.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            wait_for_workers(http, len(pool.targets))
            cards = http.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in cards] == [
                ("a", None),
                ("b", None),
                ("ad", "b"),
            ]
            assert http.get("/v1/models/b").json()["id"] == "b"
            texts = {}
            for name in "ab":
                body = {"model": name, "prompt": "Once upon a time", "max_tokens": 8}
                answer = http.post("/v1/completions", json=body | {"temperature": 0}).json()
                assert answer["model"] == name
                texts[name] = answer["choices"][0]["text"]
            assert texts["a"] != texts["b"]
            body = {"model": "ad", "prompt": "Once upon a time", "max_tokens": 8}
            answer = http.post("/v1/completions", json=body | {"temperature": 0}).json()
            assert answer["model"] == "ad" and answer["choices"][0]["text"] != texts["b"]
            body = {"model": "gpt-4", "prompt": "Once", "max_tokens": 2}
            missing = http.post("/v1/completions", json=body)
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"
            for unset in ({}, {"model": None}, {"model": ""}):  # not a 404 for ""
                body = {"prompt": "Once", "max_tokens": 2, **unset}
                unnamed = http.post("/v1/completions", json=body)
                assert unnamed.status_code == 400
                assert unnamed.json()["error"]["param"] == "model"
            # Anthropic's Messages API resolves its model the same way.
            chat = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
            assert http.post("/v1/messages", json=chat | {"model": "b"}).json()["model"] == "b"
            missing = http.post("/v1/messages", json=chat | {"model": "gpt-4"})
            assert missing.status_code == 404
            assert missing.json()["error"]["type"] == "not_found_error"
    finally:
        proc.reap()
    # Each text is its model's: the worker's own Generate names the model it holds.
    for target in pool.targets:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            held = Path(stub.GetInfo(pb.GetInfoRequest(), timeout=30).model.model).name
            name = next(n for n, path in models.items() if path.name == held)
            request = pb.GenerateRequest(
                prompt="Once upon a time",
                model=held,
                sampling_params=pb.SamplingParams(temperature=0, max_tokens=8),
            )
            assert "".join(m.text for m in stub.Generate(request, timeout=60)) == texts[name]
            adapters = stub.ListLoras(pb.ListLorasRequest(), timeout=30).names
            assert ("ad" in adapters) == (name == "b"), (name, adapters)  # loaded on b's
            request.model = "c" if held != "c" else "a"
            with pytest.raises(grpc.RpcError) as other:
                list(stub.Generate(request, timeout=60))
            assert other.value.code() == grpc.StatusCode.NOT_FOUND


def wait_for_workers(http: httpx.Client, count: int) -> None:
    for _ in range(1200):
        if http.get("/health").json().get("workers_up") == count:
            return
        time.sleep(0.1)
    pytest.fail("the gateway's workers did not come up")


def test_three_models_on_two_workers_load_on_demand(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    # Through ExecuteStream, one step ahead: a swap ends the stream to the worker.
    options = ["--metrics-port", "0", "--steps-ahead", "1"]
    fleet = start(pool, [0, 1], *model_flags(models, "abc"), *options)
    try:
        metrics_port = int(fleet.proc.wait_for(r"fleet metrics on [\d.]+:(\d+)").group(1))
        requests = [ask(m, p) for p in PROMPTS[:2] for m in "abc"]
        # One at a time first (each may wait for a load), then all at once.
        reference = [tokens(fleet.generate(r)) for r in requests]
        streams = run_streams(fleet.stub, requests * 2)
        assert [s.error for s in streams] == [None] * 12
        assert [s.tokens for s in streams] == reference * 2
        status = fleet.status()
        per_model = {m.name: m for m in status.models}
        assert {name: m.num_finished for name, m in per_model.items()} == {"a": 6, "b": 6, "c": 6}
        assert sum(m.num_loads for m in status.models) >= 1  # two workers, three models
        assert sum(w.num_loads for w in status.workers) == sum(m.num_loads for m in status.models)
        assert status.num_queued == 0
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30)
        text = scrape.read().decode()
        waited = _series(text, "mlx_fleet_time_to_first_token_after_load_seconds_count")
        assert sum(waited.values()) >= 1
        loads = _series(text, "mlx_fleet_model_loads_total")
        assert sum(loads.values()) == sum(m.num_loads for m in status.models)
        seconds = _series(text, "mlx_fleet_time_to_first_token_after_load_seconds_sum")
        load_seconds = _series(text, "mlx_fleet_model_load_seconds_sum")
        print(
            "time to first token after a load (mean, requests): "
            + ", ".join(f"{m} {seconds[m] / waited[m]:.2f} s ({waited[m]:.0f})" for m in waited)
            + "; loads (count, mean s): "
            + ", ".join(f"{m} {n:.0f} {load_seconds[m] / n:.2f}" for m, n in loads.items() if n)
        )
    finally:
        close(fleet)


def _series(text: str, name: str) -> dict[str, float]:
    pattern = rf'^{name}{{model="([^"]+)"}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def test_a_model_that_does_not_load_fails_its_requests_and_the_worker_recovers(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    fleet = start(pool, [0], "--models", f"a={models['a']}", "bad=/no/such/model")
    try:
        with pytest.raises(grpc.RpcError) as failed:
            fleet.generate(ask("bad", PROMPTS[0]))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "model 'bad' could not be loaded on worker" in str(failed.value.details())
        assert "/no/such/model" in str(failed.value.details())
        # The worker goes back to a model it can hold, and serves it.
        answer = fleet.generate(ask("a", PROMPTS[0]))
        assert len(tokens(answer)) == 8
        status = fleet.status()
        assert [w.model_name for w in status.workers] == ["a"]
        assert {m.name: m.num_loads for m in status.models}["bad"] == 0
    finally:
        close(fleet)


def test_a_gateway_request_for_a_model_that_does_not_load_is_counted_as_it_ends(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    """A /v1/messages request fails while its chat is tokenized (before the fleet routes
    it): it counts in the fleet's request metrics and logs its end, as a chat does (the
    error, reworded as itself, lost the fleet's cause, and with it both)."""
    args = ["--worker", pool.targets[0], "--port", "0", "--models", f"a={models['a']}"]
    proc = Proc(["gateway", *args, "bad=/no/such/model"])
    port = int(proc.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            wait_for_workers(http, 1)
            chat = {
                "model": "bad",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
            }
            for route in ("/v1/messages", "/v1/chat/completions"):
                failed = http.post(route, json=chat)
                assert failed.status_code == 503, failed.text
                assert "model 'bad' could not be loaded on worker" in failed.text
            metrics = http.get("/metrics").text
            assert 'mlx_fleet_requests_total{outcome="unavailable"} 2.0' in metrics
            assert _series(metrics, "mlx_fleet_model_requests_total")["bad"] == 2
            proc.wait_for(r"request failed req_id=msg_\w+ model=bad outcome=unavailable")
            proc.wait_for(r"request failed req_id=chatcmpl-\w+ model=bad outcome=unavailable")
    finally:
        proc.reap()


def test_a_model_the_worker_cannot_fetch_fails_its_requests_at_once(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id the worker cannot fetch (HF_HUB_OFFLINE here; no connection elsewhere)
    is LoadModel's UNAVAILABLE from a worker that stays up: the model failed, not the
    worker. Its request fails in seconds, after one load, naming the cause; it waited the
    30 s a worker is waited for while the fleet loaded it again and again (the worker
    put to sleep and woken on its own model each time)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # for the worker started here
    bare = WorkerPool(models["a"], size=1, auto_init=False)
    try:
        bare.start()
        hub = "mlx-community/no-such-model-4bit"
        fleet = start(bare, [0], "--models", f"a={models['a']}", f"hub={hub}")
        try:
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                fleet.generate(ask("hub", PROMPTS[2]))
            assert time.monotonic() - began < 15
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            details = str(failed.value.details())
            assert "model 'hub' could not be loaded on worker" in details
            assert "could not be fetched" in details
            assert len(tokens(fleet.generate(ask("a", PROMPTS[2])))) == 8
            assert [w.model_name for w in fleet.status().workers] == ["a"]
        finally:
            close(fleet)
    finally:
        bare.reap()


def test_a_first_model_that_does_not_load_leaves_the_worker_to_the_next(
    models: dict[str, Path],
) -> None:
    """A bare worker whose first model (`--models` order) is a bad path loads the next one
    instead of retrying the bad one for ever: requests for the good model are served."""
    bare = WorkerPool(models["a"], size=1, auto_init=False)
    try:
        bare.start()
        fleet = start(bare, [0], "--models", "bad=/no/such/model", f"a={models['a']}")
        try:
            assert len(tokens(fleet.generate(ask("a", PROMPTS[1])))) == 8
            with pytest.raises(grpc.RpcError) as failed:
                fleet.generate(ask("bad", PROMPTS[1]))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "/no/such/model" in str(failed.value.details())
            assert [w.model_name for w in fleet.status().workers] == ["a"]
        finally:
            close(fleet)
    finally:
        bare.reap()


def test_the_generate_command_answers_with_the_model_it_names(
    pool: WorkerPool, models: dict[str, Path]
) -> None:
    """`mlx-worker generate --models ... --model-name NAME` asks that model; without a name
    it is the fleet's INVALID_ARGUMENT naming the models."""
    flags = model_flags(models, "ab")
    command = [sys.executable, "-m", "mlx_worker_svc", "generate", "--worker", pool.targets[0]]
    command += [*flags, "--raw", "--max-tokens", "8"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *extra, "hello"], capture_output=True, text=True, timeout=180, check=False
        )

    unnamed = run()
    assert unnamed.returncode == 1
    assert "generate: model: the fleet serves 2 models ('a', 'b'): name one" in unnamed.stderr
    answers = {}
    for name in "ab":
        done = run("--model-name", name)
        assert done.returncode == 0, done.stderr
        answers[name] = done.stdout
    fleet = start(pool, [0], *flags)
    try:
        for name in "ab":
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=8)  # the command's
            request = pb.GenerateRequest(prompt="hello", model=name, sampling_params=sampling)
            text = "".join(message.text for message in fleet.generate(request))
            assert answers[name] == text + "\n"
    finally:
        close(fleet)
    assert answers["a"] != answers["b"], "two random models gave the same text"
