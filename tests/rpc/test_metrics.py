"""Prometheus metrics and structured logs, checked against the work done.

A worker on the tiny model (in process, metrics on port 0) runs Generate calls
of known prompt lengths and token counts, one bad call and one cancelled
mid-stream; each test scrapes `/metrics` over HTTP before and after (and
during a run), parses the text with `prometheus_client.parser`, and compares
the counters with what the responses reported. A `mlx-worker fleet` process in
front of a `mlx-worker serve` process does the same for the fleet, both with
`--metrics-port 0 --log-format json`, and their JSON log lines carry the
request ids.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from driver import bring_up, code_of, greedy
from processes import Fleet, Proc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlx_worker_svc.core.limits import AdmissionLimits
from mlx_worker_svc.core.log_format import JsonFormatter, TextFormatter
from mlx_worker_svc.core.metrics import ServerMetrics
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.security import SecurityConfig
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

NUM_BLOCKS = 512
STEP_ERRORS = "mlx_worker_stream_step_errors_total"
Labels = frozenset[tuple[str, str]]


class Scrape:
    """One scrape of a `/metrics` endpoint: sample values by name and labels."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            self.text = response.read().decode()
        self.samples: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(self.text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a labelled series not seen yet (a counter not yet hit)."""
        key = (name, frozenset(labels.items()))
        if key not in self.samples:
            assert labels, f"no sample {name} in:\n{self.text}"
            return 0.0
        return self.samples[key]


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after(name, **labels) - before(name, **labels)


def wait_for(port: int, condition: str, check: object, timeout: float = 30.0) -> Scrape:
    """Scrapes until `check(scrape)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        scrape = Scrape(port)
        if check(scrape):  # type: ignore[operator]
            return scrape
        assert time.monotonic() < deadline, f"no {condition} in {timeout:.0f} s:\n{scrape.text}"
        time.sleep(0.05)


def generate_request(prompt: list[int], max_tokens: int, req_id: str = "") -> pb.GenerateRequest:
    sampling = greedy(max_tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=sampling, request_id=req_id)


def run(stub: pb_grpc.WorkerServiceStub, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """Runs a Generate call to its end; returns the final message."""
    messages = list(stub.Generate(request, timeout=120))
    return messages[-1]


@dataclass
class Live:
    """The module's in-process worker: a stub to it, its metrics port and its epoch."""

    stub: pb_grpc.WorkerServiceStub
    port: int
    epoch: int


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[Live]:
    server = WorkerServer(ServerConfig(port=0, grace_seconds=5.0, metrics_port=0))
    server.start()
    assert server.metrics_port
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        epoch = bring_up(stub, tiny_dir, num_blocks=NUM_BLOCKS)
        yield Live(stub, server.metrics_port, epoch)
    server.shutdown(grace_seconds=1.0, abort=True)
    assert server.wait(timeout=30)
    with pytest.raises(urllib.error.URLError):  # the endpoint closed with the server
        Scrape(server.metrics_port)


def test_one_writer_histogram_buckets_are_cumulative_and_inclusive() -> None:
    metrics = ServerMetrics("t", prompt_doc="p", generation_doc="g")
    histogram = metrics.histogram("latency_seconds", "l", (0.01, 0.1, 1.0))
    for value in (0.01, 0.05, 0.1, 7.0):
        histogram.observe(value)
    metrics.prompt_tokens.inc(3)
    text = generate_latest(metrics.registry).decode()
    samples = {
        (s.name, s.labels.get("le", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # A value on a bound counts in that bound's bucket (le: less than or equal).
    buckets = [samples["t_latency_seconds_bucket", le] for le in ("0.01", "0.1", "1.0", "+Inf")]
    assert buckets == [1, 3, 3, 4]
    assert samples["t_latency_seconds_count", ""] == 4
    assert samples["t_latency_seconds_sum", ""] == pytest.approx(7.16)
    assert samples["t_prompt_tokens_total", ""] == 3


# ------------------------------------------------------------------ worker
def test_worker_counters_match_the_work_done(worker: Live) -> None:
    before = Scrape(worker.port)
    # Distinct prompts (no prefix-cache hits), run one after the other: every
    # step computes one request and samples one token.
    work = [(list(range(100, 105)), 4), (list(range(200, 209)), 7), (list(range(300, 317)), 10)]
    finals = [run(worker.stub, generate_request(p, n)) for p, n in work]
    with pytest.raises(grpc.RpcError) as bad:
        run(worker.stub, pb.GenerateRequest(prompt="both", prompt_token_ids=[1, 2]))
    assert code_of(bad.value) == grpc.StatusCode.INVALID_ARGUMENT
    after = Scrape(worker.port)

    prompt_tokens = sum(f.prompt_tokens for f in finals)
    generated = sum(f.completion_tokens for f in finals)
    assert (prompt_tokens, generated) == (5 + 9 + 17, 4 + 7 + 10)
    assert delta(before, after, "mlx_worker_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "mlx_worker_generation_tokens_total") == generated
    # One step per generated token, each a batch of one request.
    assert delta(before, after, "mlx_worker_step_duration_seconds_count") == generated
    assert delta(before, after, "mlx_worker_step_batch_size_count") == generated
    assert delta(before, after, "mlx_worker_step_batch_size_sum") == generated
    assert delta(before, after, "mlx_worker_step_duration_seconds_sum") > 0
    # KV computed: each prompt, then every sampled token but the last.
    computed = prompt_tokens + generated - len(work)
    assert delta(before, after, "mlx_worker_computed_tokens_total") == computed

    generate = {"service": "mlx_worker.v1.WorkerService", "method": "Generate"}
    assert delta(before, after, "mlx_worker_rpcs_total", **generate, code="OK") == 3
    assert delta(before, after, "mlx_worker_rpcs_total", **generate, code="INVALID_ARGUMENT") == 1

    assert after("mlx_worker_kv_blocks_used") == 0
    assert (
        after("mlx_worker_kv_blocks_free") == after("mlx_worker_kv_blocks_capacity") == NUM_BLOCKS
    )
    assert after("mlx_worker_kv_bits") == after("mlx_worker_kv_group_size") == 0  # float KV
    assert after("mlx_worker_requests_running") == after("mlx_worker_requests_preempted") == 0
    assert after("mlx_worker_steps_queued") == 0
    limits = AdmissionLimits()
    assert after("mlx_worker_max_running_requests") == limits.max_running_requests
    assert after("mlx_worker_max_queued_steps") == limits.max_queued_steps
    assert after("mlx_worker_state", state="SERVING") == 1  # Generate steps ran
    assert after("mlx_worker_state", state="NEW") == 0
    assert "_created" not in after.text  # operations.md lists every series: none of these


def test_every_token_of_a_multi_step_execute_counts_as_generated(worker: Live) -> None:
    """num_decode_steps samples several tokens a request a step; each one counts."""
    before = Scrape(worker.port)
    new = [
        pb.NewRequest(req_id=f"multi-{i}", prompt_token_ids=[500 + i, 7, 8], sampling_params=p)
        for i, p in enumerate((greedy(20, ignore_eos=True), greedy(3, ignore_eos=True)))
    ]

    def step(step_id: int, **fields: object) -> pb.ExecuteResponse:
        request = pb.ExecuteRequest(step_id=step_id, worker_epoch=worker.epoch, **fields)  # type: ignore[arg-type]
        return worker.stub.Execute(request)

    first = step(1, new_requests=new, num_scheduled_tokens={r.req_id: 3 for r in new})
    cached = [pb.CachedRequest(req_id=o.req_id, num_computed_tokens=3) for o in first.outputs]
    scheduled = {c.req_id: 1 for c in cached}
    second = step(2, cached_requests=cached, num_scheduled_tokens=scheduled, num_decode_steps=6)
    sampled = {o.req_id: len(o.sampled_token_ids) for o in second.outputs}
    assert sampled == {"multi-0": 6, "multi-1": 2}  # multi-1 reaches max_tokens 3
    # Both rows sample in the step's first decode; the last five hold one.
    assert (second.timings.num_tokens, second.timings.decode_batch_size) == (8, 2)
    step(3, finished_req_ids=["multi-0"])
    after = Scrape(worker.port)
    assert delta(before, after, "mlx_worker_generation_tokens_total") == 2 + 6 + 2
    assert delta(before, after, "mlx_worker_computed_tokens_total") == 2 * 3 + 6 + 2


def test_an_execute_stream_its_caller_cancels_counts_as_cancelled(worker: Live) -> None:
    """As operations.md has rpcs_total: the status its caller saw. The worker's side ends
    normally (its request stream ended) before gRPC may say the call was cancelled."""
    stream = {"service": "mlx_worker.v1.WorkerService", "method": "ExecuteStream"}
    before = Scrape(worker.port)
    requests: list[queue.SimpleQueue[pb.ExecuteStreamRequest | None]] = []
    for n in range(60):
        outgoing: queue.SimpleQueue[pb.ExecuteStreamRequest | None] = queue.SimpleQueue()
        requests.append(outgoing)
        step = pb.ExecuteRequest(step_id=1, worker_epoch=worker.epoch)
        step.new_requests.add(req_id=f"c{n}", prompt_token_ids=[5, 6, 7]).sampling_params.CopyFrom(
            greedy(4)
        )
        step.num_scheduled_tokens[f"c{n}"] = 3
        outgoing.put(pb.ExecuteStreamRequest(step=step))
        call = worker.stub.ExecuteStream(iter(outgoing.get, None))
        if n % 2:
            next(call)  # after its reply, or before it
        call.cancel()  # the request side stays open: no half-close races the cancel

    def counted(scrape: Scrape) -> bool:
        return delta(before, scrape, "mlx_worker_rpcs_total", **stream, code="CANCELLED") == 60

    after = wait_for(worker.port, "every cancelled stream counted", counted)
    assert delta(before, after, "mlx_worker_rpcs_total", **stream, code="OK") == 0
    for outgoing in requests:
        outgoing.put(None)  # the client's request threads end
    assert wait_for(worker.port, "idle", lambda s: s("mlx_worker_kv_blocks_used") == 0)


def test_a_scrape_during_a_run_sees_it_running(worker: Live) -> None:
    before = Scrape(worker.port)
    prompt = list(range(400, 440))  # 40 tokens: 3 blocks of 16
    call = worker.stub.Generate(
        generate_request(prompt, 470),
        timeout=120,
    )
    first = next(call)
    assert first.token_ids
    during = Scrape(worker.port)
    call.cancel()
    assert during("mlx_worker_requests_running") >= 1
    assert during("mlx_worker_kv_blocks_used") >= 3
    assert during("mlx_worker_kv_blocks_free") == NUM_BLOCKS - during("mlx_worker_kv_blocks_used")
    assert delta(before, during, "mlx_worker_generation_tokens_total") >= 1

    cancelled = {"method": "Generate", "code": "CANCELLED"}
    generate = {"service": "mlx_worker.v1.WorkerService", **cancelled}
    after = wait_for(
        worker.port,
        "cancelled Generate counted and its KV freed",
        lambda s: (
            delta(before, s, "mlx_worker_rpcs_total", **generate) == 1
            and s("mlx_worker_kv_blocks_used") == 0
        ),
    )
    assert after("mlx_worker_requests_running") == 0
    assert delta(before, after, "mlx_worker_prompt_tokens_total") == len(prompt)


def test_a_streams_refused_steps_are_logged_and_counted_by_code(
    worker: Live, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream's RPC ends OK, so rpcs_total cannot show its refused steps:
    mlx_worker_stream_step_errors_total{code} and a log line each (operations.md)."""
    stale = pb.ExecuteRequest(step_id=7, worker_epoch=worker.epoch + 1)
    unknown = pb.ExecuteRequest(step_id=8, worker_epoch=worker.epoch, finished_req_ids=["x"])
    steps = [pb.ExecuteStreamRequest(step=s) for s in (stale, unknown)]
    before = Scrape(worker.port)
    with caplog.at_level(logging.DEBUG, logger="mlx_worker_svc"):
        replies = list(worker.stub.ExecuteStream(iter(steps), timeout=60))
    codes = [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND]
    assert [r.error.code for r in replies] == [c.value[0] for c in codes]
    after = Scrape(worker.port)
    counted = [delta(before, after, STEP_ERRORS, code=c.name) for c in codes]
    assert counted == [1, 1]
    logged = [r for r in caplog.records if r.getMessage() == "stream step failed"]
    assert {r.levelno for r in logged} == {logging.DEBUG}  # its scheduler handles it
    lines = [json.loads(JsonFormatter().format(r)) for r in logged]
    assert [(x["rpc"], x["step_id"], x["code"]) for x in lines] == [
        ("ExecuteStream", 7, "FAILED_PRECONDITION"),
        ("ExecuteStream", 8, "NOT_FOUND"),
    ]
    assert lines[1]["error"] == replies[1].error.message


def test_worker_logs_carry_request_ids(worker: Live, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mlx_worker_svc"):
        final = run(worker.stub, generate_request(list(range(500, 506)), 3, "log-me"))
        with pytest.raises(grpc.RpcError):
            run(worker.stub, pb.GenerateRequest(request_id="bad-one"))
    assert final.request_id == "log-me"
    mine = [r for r in caplog.records if getattr(r, "req_id", None) == "log-me"]
    assert [r.getMessage() for r in mine] == ["request admitted", "request finished"]
    finished = json.loads(JsonFormatter().format(mine[-1]))
    assert finished["req_id"] == "log-me" and finished["level"] == "INFO"
    assert finished["logger"] == "mlx_worker_svc.worker.generation"
    assert finished["message"] == "request finished" and finished["ts"].endswith("+00:00")
    assert (finished["finish_reason"], finished["prompt_tokens"]) == ("length", 6)
    assert finished["completion_tokens"] == 3
    assert "req_id=log-me finish_reason=length" in TextFormatter().format(mine[-1])

    [refused] = [r for r in caplog.records if getattr(r, "req_id", None) == "bad-one"]
    line = json.loads(JsonFormatter().format(refused))
    assert (line["rpc"], line["code"]) == ("Generate", "INVALID_ARGUMENT")
    assert line["message"] == "rpc failed"
    assert "exactly one of prompt" in line["error"]


def test_refused_calls_are_counted_and_the_endpoint_closes_on_shutdown() -> None:
    security = SecurityConfig(tokens=("s3cret-token-for-metrics",))
    server = WorkerServer(ServerConfig(port=0, metrics_port=0, security=security))
    server.start()
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.WorkerServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
        assert code_of(refused.value) == grpc.StatusCode.UNAUTHENTICATED
        # Made-up methods, refused alike, count as one "unknown" series: a caller without
        # the token cannot grow the label set.
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for i in range(20):
                made_up = channel.unary_unary(f"/junk.Service{i}/Method{'x' * 500}", None, None)
                with pytest.raises(grpc.RpcError) as junk:
                    made_up(b"", timeout=10)
                assert code_of(junk.value) == grpc.StatusCode.UNAUTHENTICATED
        # With the token, gRPC answers them UNIMPLEMENTED; they count there too.
        token = (("authorization", "Bearer s3cret-token-for-metrics"),)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for i in range(5):
                made_up = channel.unary_unary(f"/junk.Service{i}/Method", None, None)
                with pytest.raises(grpc.RpcError) as junk:
                    made_up(b"", timeout=10, metadata=token)
                assert code_of(junk.value) == grpc.StatusCode.UNIMPLEMENTED
        scrape = Scrape(server.metrics_port)
        labels = {"service": "mlx_worker.v1.WorkerService", "method": "GetInfo"}
        assert scrape("mlx_worker_rpcs_total", **labels, code="UNAUTHENTICATED") == 1
        unknown = {"service": "unknown", "method": "unknown"}
        assert scrape("mlx_worker_rpcs_total", **unknown, code="UNAUTHENTICATED") == 20
        assert scrape("mlx_worker_rpcs_total", **unknown, code="UNIMPLEMENTED") == 5
        assert "junk" not in scrape.text
        assert scrape("mlx_worker_state", state="NEW") == 1
        assert scrape("mlx_worker_kv_blocks_capacity") == 0
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        assert server.wait(timeout=30)
    with pytest.raises(urllib.error.URLError):
        Scrape(server.metrics_port)


# ------------------------------------------------------------------- fleet
@dataclass
class Served:
    """A `serve` process behind a `fleet` process, both with metrics and JSON logs."""

    worker: Proc
    fleet_proc: Proc
    fleet: Fleet
    target: str
    worker_metrics: int
    fleet_metrics: int


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[Served]:
    json_logs = ["--metrics-port", "0", "--log-format", "json"]
    model = ["--model", str(tiny_dir), "--auto-init"]
    # DEBUG: the worker's lines about Execute requests are debug lines.
    worker = Proc(["--log-level", "DEBUG", "serve", *model, "--port", "0", *json_logs])
    procs = [worker]
    try:
        port = int(worker.wait_for(r"listening on [\d.]+:(\d+)").group(1))
        worker_metrics = int(worker.wait_for(r"metrics on [\d.]+:(\d+)").group(1))
        worker.wait_for(r"^ready:")
        target = f"127.0.0.1:{port}"
        procs.append(Proc(["fleet", "--worker", target, "--port", "0", *json_logs]))
        fleet = Fleet(procs[-1], [target])
        try:
            fleet_metrics = int(procs[-1].wait_for(r"fleet metrics on [\d.]+:(\d+)").group(1))
            fleet.wait(lambda s: all(w.up for w in s.workers), "the worker up")
            yield Served(worker, procs[-1], fleet, target, worker_metrics, fleet_metrics)
        finally:
            fleet.channel.close()
    finally:
        for proc in procs:
            proc.reap()


def json_lines(proc: Proc) -> list[dict[str, object]]:
    return [json.loads(line) for line in proc.lines if line.startswith("{")]


def test_fleet_counters_match_the_work_done(served: Served) -> None:
    fleet, target = served.fleet, served.target
    fleet_before, worker_before = Scrape(served.fleet_metrics), Scrape(served.worker_metrics)
    finals = [
        fleet.generate(generate_request(list(range(600, 606)), 5, "fleet-a"))[-1],
        fleet.generate(generate_request(list(range(700, 711)), 8, "fleet-b"))[-1],
    ]
    with pytest.raises(grpc.RpcError) as bad:
        fleet.generate(pb.GenerateRequest(request_id="fleet-bad"))
    assert code_of(bad.value) == grpc.StatusCode.INVALID_ARGUMENT
    generate = {"service": "mlx_worker.v1.FleetService", "method": "Generate"}
    # The client can hold the aborted stream's status a moment before the abort has
    # unwound through the fleet's metrics interceptor (a clean-clone CI run read 0).
    after = wait_for(
        served.fleet_metrics,
        "the refused Generate counted",
        lambda s: (
            delta(fleet_before, s, "mlx_fleet_rpcs_total", **generate, code="INVALID_ARGUMENT") >= 1
        ),
    )
    worker_after = Scrape(served.worker_metrics)

    prompt_tokens = sum(f.prompt_tokens for f in finals)
    generated = sum(f.completion_tokens for f in finals)
    assert (prompt_tokens, generated) == (6 + 11, 5 + 8)
    fleet_delta = functools.partial(delta, fleet_before, after)
    assert fleet_delta("mlx_fleet_requests_total", outcome="length") == 2
    assert fleet_delta("mlx_fleet_requests_total", outcome="invalid_argument") == 1
    assert fleet_delta("mlx_fleet_prompt_tokens_total") == prompt_tokens
    assert fleet_delta("mlx_fleet_generation_tokens_total") == generated
    assert fleet_delta("mlx_fleet_time_to_first_token_seconds_count") == 2
    assert fleet_delta("mlx_fleet_request_duration_seconds_count") == 3
    assert fleet_delta("mlx_fleet_rpcs_total", **generate, code="OK") == 2
    assert fleet_delta("mlx_fleet_rpcs_total", **generate, code="INVALID_ARGUMENT") == 1
    assert after("mlx_fleet_requests_queued") == 0
    assert after("mlx_fleet_worker_up", worker=target) == 1
    assert after("mlx_fleet_worker_requests", worker=target) == 0
    assert after("mlx_fleet_worker_kv_blocks_used", worker=target) == 0
    assert after("mlx_fleet_failovers_total", worker=target) == 0

    # The worker counted the same tokens, through the fleet's steps (ExecuteStream).
    worker_delta = functools.partial(delta, worker_before, worker_after)
    assert worker_delta("mlx_worker_prompt_tokens_total") == prompt_tokens
    assert worker_delta("mlx_worker_generation_tokens_total") == generated
    assert worker_after("mlx_worker_kv_blocks_used") == 0
    # At least one step per token of the longer request (the stream stays open, so
    # its RPC is not counted yet: count the steps).
    assert worker_delta("mlx_worker_step_duration_seconds_count") >= 8


def test_fleet_and_worker_json_logs_carry_request_ids(served: Served) -> None:
    served.fleet.generate(generate_request(list(range(800, 807)), 4, "fleet-log"))
    with pytest.raises(grpc.RpcError):
        served.fleet.generate(pb.GenerateRequest(request_id="fleet-log-bad"))
    # Lines are read from the processes' output as it comes: wait for the last ones.
    for proc, message, req_id in (
        (served.fleet_proc, "request finished", "fleet-log"),
        (served.fleet_proc, "request failed", "fleet-log-bad"),
        (served.worker, "request finished", "fleet-log#1"),
    ):
        proc.wait_for(f'(?=.*"message": ?"{message}")(?=.*"req_id": ?"{req_id}")', timeout=30)
    ended = {
        line["req_id"]: line
        for line in json_lines(served.fleet_proc)
        if line["message"] in ("request finished", "request failed")
    }
    finished = ended["fleet-log"]
    assert (finished["level"], finished["logger"]) == ("INFO", "mlx_worker_svc.fleet.scheduler")
    assert (finished["outcome"], finished["completion_tokens"]) == ("length", 4)
    assert finished["worker"] == served.target
    assert {"ts", "message", "prompt_tokens"} <= finished.keys()
    failed = ended["fleet-log-bad"]
    assert (failed["level"], failed["outcome"]) == ("WARNING", "invalid_argument")
    # The worker's lines for the same request, under its worker-side id.
    on_worker = {
        (line["message"], line.get("req_id")): line
        for line in json_lines(served.worker)
        if line["logger"] == "mlx_worker_svc.worker.core"
    }
    assert ("request admitted", "fleet-log#1") in on_worker
    done = on_worker["request finished", "fleet-log#1"]
    assert (done["prompt_tokens"], done["completion_tokens"]) == (7, 4)
