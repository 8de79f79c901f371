"""LoRA adapters across a fleet: routed to the worker holding them, loaded on demand, and
served by the gateway as model ids.

Two worker processes on the tiny model, an adapter loaded on one of them at
start (`serve --lora-modules`): every request naming it runs there, with
mlx-lm's tokens for that adapter; a fleet given another adapter's path
(`fleet --lora-modules`) loads it on a worker when a request names it; the
gateway lists the adapter in /v1/models with its parent model and the `openai`
client gets the adapter's text.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import openai
import pytest
from driver import code_of, details_of
from gateway_process import KEY, NO_EOS, Gateway
from lora_adapters import make_adapter
from mlx_lm import load
from mlx_lm.generate import generate_step
from processes import Fleet, Proc, by_target, distinct_prompts, token_request, tokens_of

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, fleet_model: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet-adapters")
    return {
        "held": make_adapter(root / "held", fleet_model, seed=21, keys=None),
        "later": make_adapter(root / "later", fleet_model, seed=22),
    }


@pytest.fixture(scope="module")
def workers(fleet_model: Path, adapters: dict[str, Path]) -> Iterator[list[str]]:
    """Two workers; the first holds adapter "held" from its start."""
    base = ["serve", "--model", str(fleet_model), "--auto-init", "--port", "0"]
    procs = [
        Proc([*base, "--grace-seconds", "1", "--lora-modules", f"held={adapters['held']}"]),
        Proc([*base, "--grace-seconds", "1"]),
    ]
    try:
        ports = [int(p.wait_for(r"listening on [\d.]+:(\d+)").group(1)) for p in procs]
        for proc in procs:
            proc.wait_for(r"^ready:")
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            proc.reap()


def reference(model: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    loaded, _ = load(str(model), adapter_path=str(adapter) if adapter else None)
    return [
        [int(t) for t, _ in generate_step(mx.array(p), loaded, max_tokens=TOKENS)] for p in prompts
    ]


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> Any:
    """The gateway's greedy completion of `prompt` by `model` (an adapter's id), EOS ignored."""
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, extra_body=NO_EOS
    )


def _fleet(targets: list[str], *options: str) -> Iterator[Fleet]:
    workers = [arg for target in targets for arg in ("--worker", target)]
    fleet = Fleet(Proc(["fleet", *workers, "--port", "0", *options]), targets)
    try:
        fleet.wait(lambda s: all(w.up for w in s.workers), "every worker up")
        yield fleet
    finally:
        fleet.channel.close()
        fleet.proc.reap()


@pytest.fixture
def start_fleet(workers: list[str]) -> Iterator[Callable[..., Fleet]]:
    opened: list[Iterator[Fleet]] = []

    def start(*options: str) -> Fleet:
        opened.append(_fleet(workers, *options))
        return next(opened[-1])

    yield start
    for fleet in opened:
        next(fleet, None)


def test_requests_naming_an_adapter_run_where_it_is(
    workers: list[str],
    start_fleet: Callable[..., Fleet],
    fleet_model: Path,
    adapters: dict[str, Path],
) -> None:
    fleet = start_fleet()
    holder, other = workers
    status = by_target(fleet.status())
    assert list(status[holder].lora_adapters) == ["held"] and not status[other].lora_adapters
    prompts = distinct_prompts(6, 12, seed=7)
    want = reference(fleet_model, adapters["held"], prompts)
    assert want != reference(fleet_model, None, prompts)
    got = []
    for prompt in prompts:
        request = token_request(prompt, TOKENS)
        request.lora_name = "held"
        got.append(tokens_of(fleet.generate(request)))
    assert got == want
    after = by_target(fleet.status())
    assert after[holder].num_finished - status[holder].num_finished == 6
    assert after[other].num_finished == status[other].num_finished
    unknown = token_request(prompts[0], TOKENS)
    unknown.lora_name = "nowhere"
    with pytest.raises(grpc.RpcError) as info:
        fleet.generate(unknown)
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    assert "lora_name" in details_of(info.value) and "'nowhere'" in details_of(info.value)


def test_the_fleet_loads_an_adapter_it_knows_the_path_of(
    start_fleet: Callable[..., Fleet], fleet_model: Path, adapters: dict[str, Path]
) -> None:
    fleet = start_fleet("--lora-modules", f"later={adapters['later']}")
    prompts = distinct_prompts(2, 10, seed=9)
    want = reference(fleet_model, adapters["later"], prompts)
    got = []
    for prompt in prompts:
        request = token_request(prompt, TOKENS)
        request.lora_name = "later"
        got.append(tokens_of(fleet.generate(request)))
    assert got == want
    holding = [w.target for w in fleet.status().workers if "later" in w.lora_adapters]
    assert len(holding) == 1  # loaded once, on one worker
    with grpc.insecure_channel(holding[0]) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        assert "later" in stub.ListLoras(pb.ListLorasRequest()).names
        stub.RemoveLora(pb.RemoveLoraRequest(name="later"))  # the next test's fleets start clean


def test_the_generate_command_answers_with_the_adapter_it_names(
    workers: list[str], start_fleet: Callable[..., Fleet], adapters: dict[str, Path]
) -> None:
    """`mlx-worker generate --lora-name NAME` asks that adapter, held by a worker or loaded
    from the command's own --lora-modules; an adapter nobody has is NOT_FOUND, exit 1."""
    command = [sys.executable, "-m", "mlx_worker_svc", "generate", "--raw", "--max-tokens", "8"]
    command += [arg for target in workers for arg in ("--worker", target)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *extra, "hello"], capture_output=True, text=True, timeout=180, check=False
        )

    answers = {
        "held": run("--lora-name", "held"),
        "later": run("--lora-modules", f"later={adapters['later']}", "--lora-name", "later"),
        "": run(),
    }
    assert all(done.returncode == 0 for done in answers.values()), answers
    missing = run("--lora-name", "nowhere")
    assert missing.returncode == 1 and "lora_name" in missing.stderr
    assert "'nowhere'" in missing.stderr
    fleet = start_fleet()
    for name, done in answers.items():
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=8)  # the command's
        request = pb.GenerateRequest(prompt="hello", lora_name=name, sampling_params=sampling)
        assert done.stdout == "".join(m.text for m in fleet.generate(request)) + "\n", name
    assert len({done.stdout for done in answers.values()}) == 3, "adapters gave the base text"
    holding = [w.target for w in fleet.status().workers if "later" in w.lora_adapters]
    with grpc.insecure_channel(holding[0]) as channel:  # the next test's fleets start clean
        pb_grpc.WorkerServiceStub(channel).RemoveLora(pb.RemoveLoraRequest(name="later"))


def test_the_gateway_serves_adapters_as_models(
    workers: list[str], fleet_model: Path, adapters: dict[str, Path]
) -> None:
    holder, other = workers
    port = int(holder.rsplit(":", 1)[1])
    gateway = Gateway(port, "--worker", other, "--lora-modules", f"later={adapters['later']}")
    try:
        listed = gateway.http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
        cards = {card["id"]: card for card in listed["data"]}
        assert cards["held"]["parent"] == "model" and cards["model"]["parent"] is None
        # Not held by any worker yet: listed from --lora-modules, loaded when asked for.
        assert cards["later"]["parent"] == "model"
        assert cards["later"]["root"] == str(adapters["later"])
        [prompt] = distinct_prompts(1, 12, seed=11)
        [want] = reference(fleet_model, adapters["held"], [prompt])
        [later] = reference(fleet_model, adapters["later"], [prompt])
        with grpc.insecure_channel(holder) as channel:
            worker = pb_grpc.WorkerServiceStub(channel)
            text = worker.Detokenize(pb.DetokenizeRequest(token_ids=want, skip_special_tokens=True))
            later_text = worker.Detokenize(
                pb.DetokenizeRequest(token_ids=later, skip_special_tokens=True)
            )
        with gateway.client() as client:
            loaded = _complete(client, "later", prompt)
            assert loaded.model == "later" and loaded.choices[0].text == later_text.text
            answer = _complete(client, "held", prompt)
            base = _complete(client, "model", prompt)
        assert answer.model == "held" and answer.choices[0].text == text.text
        assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
        assert base.choices[0].text != text.text
    finally:
        gateway.close()


def test_an_adapter_the_worker_evicts_is_no_longer_routed_there(
    fleet_model: Path, adapters: dict[str, Path]
) -> None:
    """A worker of --max-loras 1 gives up its own adapter for the one the fleet loads: the
    fleet drops it from the worker's list and takes the KV budget the load left
    (AddLoraResponse.kv); asked for again, the worker's own comes back from the path the
    worker reported, in place of the fleet's."""
    flags = [
        "--max-loras",
        "1",
        "--grace-seconds",
        "1",
        "--lora-modules",
        f"held={adapters['held']}",
    ]
    worker = Proc(["serve", "--model", str(fleet_model), "--auto-init", "--port", "0", *flags])
    try:
        port = worker.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        target = f"127.0.0.1:{port}"
        worker.wait_for(r"^ready:")
        started = _fleet([target], "--lora-modules", f"later={adapters['later']}")
        fleet = next(started)
        try:
            assert list(fleet.worker(target).lora_adapters) == ["held"]
            [prompt] = distinct_prompts(1, 10, seed=13)
            request = token_request(prompt, TOKENS)
            request.lora_name = "later"
            assert (
                tokens_of(fleet.generate(request))
                == reference(fleet_model, adapters["later"], [prompt])[0]
            )
            status = fleet.worker(target)
            assert list(status.lora_adapters) == ["later"]
            with grpc.insecure_channel(target) as channel:
                health = pb_grpc.WorkerServiceStub(channel).CheckHealth(pb.CheckHealthRequest())
            assert status.kv.num_blocks == health.kv.num_blocks
            request.lora_name = "held"  # removed for room; its path is the worker's
            assert (
                tokens_of(fleet.generate(request))
                == reference(fleet_model, adapters["held"], [prompt])[0]
            )
            assert list(fleet.worker(target).lora_adapters) == ["held"]
        finally:
            next(started, None)  # the fleet stops
    finally:
        worker.reap()


def test_a_workers_own_adapter_removed_from_outside_is_loaded_again(
    fleet_model: Path, adapters: dict[str, Path]
) -> None:
    """A RemoveLora from outside takes a worker's own adapter: the fleet loads it again
    from the path the worker reported when it came up, and the request gets its tokens
    (it waited the fleet's 30 s and failed, and the adapter left the fleet's list)."""
    flags = ["--grace-seconds", "1", "--lora-modules", f"held={adapters['held']}"]
    worker = Proc(["serve", "--model", str(fleet_model), "--auto-init", "--port", "0", *flags])
    try:
        port = worker.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        target = f"127.0.0.1:{port}"
        worker.wait_for(r"^ready:")
        started = _fleet([target])
        fleet = next(started)
        try:
            [prompt] = distinct_prompts(1, 10, seed=17)
            want = reference(fleet_model, adapters["held"], [prompt])[0]
            request = token_request(prompt, TOKENS)
            request.lora_name = "held"
            assert tokens_of(fleet.generate(request)) == want
            with grpc.insecure_channel(target) as channel:
                pb_grpc.WorkerServiceStub(channel).RemoveLora(pb.RemoveLoraRequest(name="held"))
            again = list(fleet.stub.Generate(request, timeout=20))  # not the fleet's 30 s wait
            assert tokens_of(again) == want
            assert list(fleet.worker(target).lora_adapters) == ["held"]
        finally:
            next(started, None)  # the fleet stops
    finally:
        worker.reap()


def test_an_adapter_added_from_outside_is_routed_to_and_listed(
    workers: list[str], fleet_model: Path, adapters: dict[str, Path]
) -> None:
    """An AddLora sent to a worker after the fleet found it (an operator's grpcurl): the
    fleet and the gateway read the workers' adapters again when a request or a model list
    names one they do not know, so it is routed to and listed (it was NOT_FOUND / 404)."""
    other = workers[1]
    started = _fleet([other])  # one worker: the adapter is loaded again where it was
    fleet = next(started)
    [prompt] = distinct_prompts(1, 12, seed=23)
    [want] = reference(fleet_model, adapters["later"], [prompt])
    added = ["outside", "asked-for", "looked-up", "listed", "model"]
    with grpc.insecure_channel(other) as channel:
        worker = pb_grpc.WorkerServiceStub(channel)

        def add(name: str) -> None:
            worker.AddLora(pb.AddLoraRequest(name=name, path=str(adapters["later"])))

        add("outside")
        gateway = Gateway(int(other.rsplit(":", 1)[1]))
        try:
            request = token_request(prompt, TOKENS)
            request.lora_name = "outside"
            assert tokens_of(fleet.generate(request)) == want
            assert list(fleet.worker(other).lora_adapters) == ["outside"]
            # Removed from outside too: loaded again from the path ListLoras gave, as a
            # worker's own is (it waited the fleet's 30 s and failed UNAVAILABLE).
            worker.RemoveLora(pb.RemoveLoraRequest(name="outside"))
            assert tokens_of(list(fleet.stub.Generate(request, timeout=20))) == want
            assert list(fleet.worker(other).lora_adapters) == ["outside"]
            text = worker.Detokenize(pb.DetokenizeRequest(token_ids=want, skip_special_tokens=True))
            add("asked-for")
            with gateway.client() as client:
                answer = _complete(client, "asked-for", prompt)
            assert answer.model == "asked-for" and answer.choices[0].text == text.text
            auth = {"Authorization": f"Bearer {KEY}"}
            add("looked-up")
            card = gateway.http.get("/v1/models/looked-up", headers=auth)
            assert card.status_code == 200 and card.json()["parent"] == "model"
            add("listed")
            add("model")  # the model's own name: the model wins, and a WARNING says so
            listed = gateway.http.get("/v1/models", headers=auth).json()
            cards = {card["id"]: card for card in listed["data"]}
            assert set(cards) >= set(added) and cards["model"]["parent"] is None
            gateway.proc.wait_for("adapter model has the name of a model of the fleet")
            # Removed from outside, it stays listed and is loaded again when asked for.
            worker.RemoveLora(pb.RemoveLoraRequest(name="listed"))
            listed = gateway.http.get("/v1/models", headers=auth).json()
            assert "listed" in {card["id"] for card in listed["data"]}
            with gateway.client() as client:
                again = _complete(client, "listed", prompt)
            assert again.choices[0].text == text.text
        finally:
            gateway.close()
            next(started, None)  # the fleet stops
            for name in added:
                worker.RemoveLora(pb.RemoveLoraRequest(name=name))
