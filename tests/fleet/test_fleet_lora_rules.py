"""The fleet's rules for adapters: each runs on its own model, a load never evicts an
adapter requests were routed to, and a worker that refuses or loses one fails no
other request.

Two tiny random llamas (a, b) with an adapter each; a worker started on `a` with
its own adapter (`serve --lora-modules`), a bare one the fleet gives `b`; a
worker of `--max-loras 1` that the fleet must share between two adapters
requested at once. Every answer is checked against mlx-lm's tokens for that
model and adapter.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import mlx.core as mx
import pytest
from driver import code_of, details_of
from lora_adapters import make_adapter
from mlx_lm import load
from mlx_lm.generate import generate_step
from processes import Fleet, Proc, distinct_prompts, run_streams, token_request, tokens_of
from tiny_model import build_tiny_model

from mlx_worker_svc.fleet.adapters import AdapterPlacement
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

TOKENS = 8


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-rules")
    a = build_tiny_model(root / "a", smollm_dir, seed=3)
    b = build_tiny_model(root / "b", smollm_dir, seed=4)
    return {
        "a": a,
        "b": b,
        "own": make_adapter(root / "own", a, seed=31),  # a's worker's own
        "ad": make_adapter(root / "ad", b, seed=32),  # b's, given to the fleet
        "x": make_adapter(root / "x", a, seed=33),
        "y": make_adapter(root / "y", a, seed=34),
    }


def reference(model: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    loaded, _ = load(str(model), adapter_path=str(adapter) if adapter else None)
    return [
        [int(t) for t, _ in generate_step(mx.array(p), loaded, max_tokens=TOKENS)] for p in prompts
    ]


def worker(*flags: str) -> tuple[Proc, str]:
    proc = Proc(["serve", "--port", "0", "--grace-seconds", "1", *flags])
    port = proc.wait_for(r"listening on [\d.]+:(\d+)").group(1)
    if "--auto-init" in flags:
        proc.wait_for(r"^ready:")
    return proc, f"127.0.0.1:{port}"


def fleet(targets: list[str], *options: str) -> Fleet:
    args = [arg for target in targets for arg in ("--worker", target)]
    started = Fleet(Proc(["fleet", *args, "--port", "0", *options]), targets)
    started.wait(lambda s: all(w.up for w in s.workers), "every worker up", timeout=120)
    return started


def ask(prompt: list[int], model: str, lora: str) -> pb.GenerateRequest:
    request = token_request(prompt, TOKENS)
    request.model, request.lora_name = model, lora
    return request


@pytest.fixture(scope="module")
def two_models(tree: dict[str, Path]) -> Iterator[Fleet]:
    """Worker 1 holds a with its own adapter `own` (of two slots); worker 2 is given b by
    the fleet; the fleet may load `ad` (of b) and `x` (of a)."""
    own_a = ["--model", str(tree["a"]), "--lora-modules", f"own={tree['own']}"]
    procs = [worker(*own_a, "--auto-init", "--max-loras", "2"), worker()]
    specs = [
        json.dumps({"name": "ad", "path": str(tree["ad"]), "base_model_name": "b"}),
        json.dumps({"name": "x", "path": str(tree["x"]), "base_model_name": "a"}),
    ]
    models = ["--models", f"a={tree['a']}", f"b={tree['b']}"]
    started = None
    try:
        started = fleet([t for _, t in procs], *models, "--lora-modules", *specs)
        yield started
    finally:
        if started is not None:
            started.channel.close()
            started.proc.reap()
        for proc, _ in procs:
            proc.reap()


@pytest.mark.parametrize(("model", "lora", "base"), [("a", "ad", "b"), ("b", "own", "a")])
def test_an_adapter_of_another_model_is_refused_naming_lora_name(
    two_models: Fleet, model: str, lora: str, base: str
) -> None:
    """`ad` was given with base_model_name b; `own` came with the worker of a: neither
    runs on the other model (the answer would be that model's with another's adapter)."""
    [prompt] = distinct_prompts(1, 10, seed=5)
    with pytest.raises(grpc.RpcError) as info:
        two_models.generate(ask(prompt, model, lora))
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(info.value).startswith(
        f"lora_name: adapter {lora!r} is an adapter of model {base!r}, not of {model!r}"
    )


def test_a_request_naming_no_model_runs_on_its_adapters(
    two_models: Fleet, tree: dict[str, Path]
) -> None:
    prompts = distinct_prompts(2, 10, seed=6)
    for lora, model in (("ad", "b"), ("own", "a")):
        want = reference(tree[model], tree[lora], prompts)
        assert [tokens_of(two_models.generate(ask(p, "", lora))) for p in prompts] == want


def test_an_adapter_added_from_outside_seen_as_the_fleet_loads_one_runs_on_its_model(
    two_models: Fleet, tree: dict[str, Path]
) -> None:
    """An operator's AddLora of `e` fills the second slot of the worker of a; the fleet
    then loads `x` there, reads what the worker holds and removes `e` to make room: a
    request naming only `e` loads it again on a (it was INVALID_ARGUMENT asking for a
    model, the fleet serving two)."""
    with grpc.insecure_channel(two_models.targets[0]) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        stub.AddLora(pb.AddLoraRequest(name="e", path=str(tree["y"])))
        prompts = distinct_prompts(2, 10, seed=13)
        [want_x] = reference(tree["a"], tree["x"], prompts[:1])
        [want_e] = reference(tree["a"], tree["y"], prompts[1:])
        assert tokens_of(two_models.generate(ask(prompts[0], "", "x"))) == want_x
        assert "e" not in stub.ListLoras(pb.ListLorasRequest()).names
        assert tokens_of(two_models.generate(ask(prompts[1], "", "e"))) == want_e


def test_a_workers_own_adapter_keeps_the_model_it_came_with() -> None:
    """Learned from the first worker seen holding it: the same worker holding another
    model later (the fleet swapped it) does not move the adapter to that model."""
    placement = AdapterPlacement()
    link = SimpleNamespace(
        target="w", model_name="b", adapters={"own"}, adapter_paths={"own": "/own"}
    )
    placement.learn(link)  # type: ignore[arg-type]
    link.model_name = "a"  # swapped; the worker's --lora-modules loaded `own` again
    placement.learn(link)  # type: ignore[arg-type]
    assert placement.parents([link], ["a", "b"]) == {"own": "b"}  # type: ignore[list-item]
    assert placement.path_of("own") == "/own"  # the worker reported it: loaded again when gone
    with pytest.raises(Exception, match="adapter 'own' is an adapter of model 'b'"):
        placement.check("own", "a")


def test_one_adapter_name_from_two_paths_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The fleet knows an adapter by its name: a worker holding one of a known name from
    another path may run requests meant for the first; a WARNING says so, once."""
    placement = AdapterPlacement({"cfg": "/cfg"})
    first = SimpleNamespace(
        target="w1", model_name="a", adapters={"ext", "cfg"}, adapter_paths={"ext": "/a/ext"}
    )
    other = SimpleNamespace(
        target="w2",
        model_name="a",
        adapters={"ext", "cfg"},
        adapter_paths={"ext": "/b/ext", "cfg": "/elsewhere"},
    )
    with caplog.at_level("WARNING", logger="mlx_worker_svc.fleet.adapters"):
        for link in (first, first, other, other):
            placement.learn(link)  # type: ignore[arg-type]
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "adapter ext on worker w2 comes from /b/ext, but the fleet knows it from /a/ext: "
        "requests for ext may run on either; give different adapters different names",
        "adapter cfg on worker w2 comes from /elsewhere, but the fleet knows it from /cfg: "
        "requests for cfg may run on either; give different adapters different names",
    ]
    assert (placement.path_of("ext"), placement.path_of("cfg")) == ("/a/ext", "/cfg")


@pytest.fixture(scope="module")
def one_slot(tree: dict[str, Path]) -> Iterator[tuple[Fleet, str]]:
    """One worker of --max-loras 1; the fleet knows two adapters' paths."""
    proc, target = worker("--model", str(tree["a"]), "--auto-init", "--max-loras", "1")
    started = None
    try:
        specs = [f"x={tree['x']}", f"y={tree['y']}", f"gone={tree['b']}"]
        started = fleet([target], "--lora-modules", *specs)
        yield started, target
    finally:
        if started is not None:
            started.channel.close()
            started.proc.reap()
        proc.reap()


def test_two_adapters_asked_at_once_share_one_slot_without_failing_anyone(
    one_slot: tuple[Fleet, str], tree: dict[str, Path]
) -> None:
    """Requests for x, y and the base model at once, on a worker that holds one adapter:
    a load waits while its slot is needed (no request routed to x loses it to y), and
    every answer is its adapter's."""
    fleet_, _ = one_slot
    prompts = distinct_prompts(18, 10, seed=7)
    loras = ["x", "y", ""] * 6
    want = {
        lora: reference(tree["a"], tree[lora] if lora else None, prompts[i::3])
        for i, lora in enumerate(["x", "y", ""])
    }
    requests = [ask(p, "", lora) for p, lora in zip(prompts, loras, strict=True)]
    streams = run_streams(fleet_.stub, requests)
    assert [(s.error and details_of(s.error)) for s in streams] == [None] * 18
    for i, lora in enumerate(["x", "y", ""]):
        assert [s.tokens for s in streams[i::3]] == want[lora], lora


def test_an_adapter_removed_behind_the_fleets_back_is_loaded_again(
    one_slot: tuple[Fleet, str], tree: dict[str, Path]
) -> None:
    fleet_, target = one_slot
    prompts = distinct_prompts(2, 10, seed=8)
    [first, second] = reference(tree["a"], tree["x"], prompts)
    assert tokens_of(fleet_.generate(ask(prompts[0], "", "x"))) == first
    with grpc.insecure_channel(target) as channel:
        pb_grpc.WorkerServiceStub(channel).RemoveLora(pb.RemoveLoraRequest(name="x"))
    assert tokens_of(fleet_.generate(ask(prompts[1], "", "x"))) == second


def test_an_adapter_the_worker_refuses_fails_as_the_fleets_not_the_callers(
    one_slot: tuple[Fleet, str],
) -> None:
    """`gone` points at a model directory, not an adapter: the worker refuses to load
    it, and the caller is told it is the fleet's adapter that failed, on which worker."""
    fleet_, target = one_slot
    [prompt] = distinct_prompts(1, 10, seed=9)
    with pytest.raises(grpc.RpcError) as info:
        fleet_.generate(ask(prompt, "", "gone"))
    assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
    assert details_of(info.value).startswith("lora_name: adapter 'gone' (fleet --lora-modules, ")
    assert f"does not load on worker {target}: INVALID_ARGUMENT: " in details_of(info.value)
    assert tokens_of(fleet_.generate(ask(prompt, "", "")))  # the worker serves on


def test_an_adapter_no_one_has_is_not_found_without_a_model(two_models: Fleet) -> None:
    """Not "name a model": the adapter is what is missing."""
    [prompt] = distinct_prompts(1, 10, seed=10)
    with pytest.raises(grpc.RpcError) as info:
        two_models.generate(ask(prompt, "", "nope"))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    assert "lora_name: no worker of the fleet holds adapter 'nope'" in details_of(info.value)


def test_a_workers_own_adapter_removed_for_room_is_loaded_again(tree: dict[str, Path]) -> None:
    """The worker's own `w` (serve --lora-modules) makes room for the fleet's `x` on its
    one slot; asked for later, `w` comes back from the path the worker reported. A slot
    pinned by another client makes a load wait, and the fleet says why."""
    proc, target = worker(
        "--model", str(tree["a"]), "--auto-init", "--max-loras", "1",
        "--lora-modules", f"w={tree['own']}",
    )  # fmt: skip
    started = None
    try:
        started = fleet([target], "--lora-modules", f"x={tree['x']}")
        prompts = distinct_prompts(3, 10, seed=11)
        [want_x] = reference(tree["a"], tree["x"], prompts[:1])
        [want_w] = reference(tree["a"], tree["own"], prompts[1:2])
        assert tokens_of(started.generate(ask(prompts[0], "", "x"))) == want_x
        assert tokens_of(started.generate(ask(prompts[1], "", "w"))) == want_w
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stub.PinLora(pb.PinLoraRequest(name="w"))
            with pytest.raises(grpc.RpcError) as waited:
                started.stub.Generate(ask(prompts[2], "", "x"), timeout=5).next()
            assert code_of(waited.value) == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "adapter x waits: every --max-loras slot of" in started.proc.output
            stub.PinLora(pb.PinLoraRequest(name="w", unpin=True))
        assert tokens_of(started.generate(ask(prompts[0], "", "x"))) == want_x
    finally:
        if started is not None:
            started.channel.close()
            started.proc.reap()
        proc.reap()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_worker_lost_as_it_is_chosen_to_load_an_adapter_fails_no_request(
    tree: dict[str, Path], how: signal.Signals
) -> None:
    """The least loaded worker, picked to load the adapter, dies or hangs before the
    fleet sees it go: the request waits and runs on the other worker (it once failed
    UNAVAILABLE at once, or after two minutes of retried ListLoras on a hung one)."""
    procs = [worker("--model", str(tree["a"]), "--auto-init") for _ in range(2)]
    started = None
    try:
        started = fleet([t for _, t in procs], "--lora-modules", f"x={tree['x']}")
        [prompt] = distinct_prompts(1, 10, seed=12)
        [want] = reference(tree["a"], tree["x"], [prompt])
        procs[0][0].proc.send_signal(how)  # the first of two idle workers: the one picked
        answer = list(started.stub.Generate(ask(prompt, "", "x"), timeout=60))
        assert tokens_of(answer) == want
        holders = [w.target for w in started.status().workers if "x" in w.lora_adapters]
        assert holders == [procs[1][1]]
    finally:
        if started is not None:
            started.channel.close()
            started.proc.reap()
        if how is signal.SIGSTOP:
            procs[0][0].proc.send_signal(signal.SIGCONT)
        for proc, _ in procs:
            proc.reap()


def test_an_adapter_whose_model_left_the_fleet_is_named_for_a_request_of_no_model(
    tree: dict[str, Path],
) -> None:
    """`x` was first seen on the worker's model a; then the worker was given model b
    from outside (LoadModel): a request naming only `x` is NOT_FOUND naming lora_name and
    that model, not `model`, a field it never sent."""
    proc, target = worker("--model", str(tree["a"]), "--auto-init")
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stub.AddLora(pb.AddLoraRequest(name="x", path=str(tree["x"])))
            started = fleet([target], "--lora-modules", f"x={tree['x']}")
            try:
                a_name = started.worker(target).model_name
                stub.RemoveLora(pb.RemoveLoraRequest(name="x"))
                stub.LoadModel(pb.LoadModelRequest(model=str(tree["b"])))
                started.wait(
                    lambda s: s.workers[0].up and s.workers[0].model_name != a_name,
                    "the worker back with model b",
                    timeout=120,
                )
                b_name = started.worker(target).model_name
                [prompt] = distinct_prompts(1, 10, seed=12)
                with pytest.raises(grpc.RpcError) as info:
                    started.generate(ask(prompt, "", "x"))
                assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
                assert details_of(info.value).startswith(
                    f"lora_name: adapter 'x' runs on model {a_name!r}, which the fleet does "
                    f"not serve now (it serves {b_name!r})"
                )
            finally:
                started.channel.close()
                started.proc.reap()
    finally:
        proc.reap()


def test_an_adapter_added_from_outside_outlives_a_model_swap(tree: dict[str, Path]) -> None:
    """An operator's AddLora of `e` on the one worker (model a); the fleet then swaps the
    worker to model b, which drops its adapters: a request naming only `e` brings a and
    `e` back (it was NOT_FOUND: the fleet never read the worker's adapters before the
    swap, so it had no path for `e`)."""
    proc, target = worker()
    started = None
    try:
        started = fleet([target], "--models", f"a={tree['a']}", f"b={tree['b']}")
        [first, second] = distinct_prompts(2, 10, seed=14)
        [want_e] = reference(tree["a"], tree["y"], [second])
        assert len(tokens_of(started.generate(ask(first, "a", "")))) == TOKENS
        with grpc.insecure_channel(target) as channel:
            pb_grpc.WorkerServiceStub(channel).AddLora(
                pb.AddLoraRequest(name="e", path=str(tree["y"]))
            )
        assert len(tokens_of(started.generate(ask(first, "b", "")))) == TOKENS  # the swap
        assert tokens_of(started.generate(ask(second, "", "e"))) == want_e
    finally:
        if started is not None:
            started.channel.close()
            started.proc.reap()
        proc.reap()
