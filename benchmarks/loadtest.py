"""`python -m benchmarks.loadtest`: a bounded load test at several times the admission limit.

Starts `mlx-worker serve --auto-init` (unless `--model`: the embedded SmolLM2
as float32, which BLAS runs fast on a CPU; prefix cache off, so memory shows
leaks rather than a filling cache) with
`--max-running-requests N` as its own process, then runs `--overload` x N client
threads on loopback, each sending Generate requests back to back until
`--requests` have been accepted or `--seconds` have passed. A request is

- accepted when it streams; it must end with exactly the tokens it asked for,
- rejected when the worker answers RESOURCE_EXHAUSTED before any token (the
  client waits `--backoff` and tries again),
- lost in every other case: another status, a shed request, a short answer.

Meanwhile a prober calls `grpc.health.v1.Health/Check` every `--probe-every`
seconds (what a load balancer does) and a sampler reads the worker's CheckHealth
(running requests, MLX memory) and its resident memory once a second. After the
load the worker gets SIGTERM and must exit 0.

PASS when 0 requests are lost, some were rejected (the limit was reached), the
worker was saturated in most samples, health p99 is under `--health-p99-ms`, and
it drained cleanly. Writes `benchmarks/results/<date>-loadtest-<machine>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common import (
    MIB,
    RESULTS,
    float32_copy,
    machine_facts,
    machine_name,
    percentile,
    rss_bytes,
    slope,
    temp_dir,
)
from mlx_worker_svc.cli import envs
from mlx_worker_svc.engine.model.embedded import ensure_default_model
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

SERVICE = "mlx_worker.v1.WorkerService"


def log(message: str) -> None:
    print(f"[loadtest {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class WorkerProcess:
    """`mlx-worker serve --auto-init` as a child process, ready when it says so."""

    def __init__(self, model: str, limit: int, queued: int) -> None:
        command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--auto-init", "--port", "0"]
        command += ["--max-running-requests", str(limit), "--max-queued-steps", str(queued)]
        command += ["--model", model, "--no-prefix-caching"]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.port = 0
        self.log: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            match = re.search(r"listening on [\d.]+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
            if line.startswith("ready:"):
                log(line.strip())
                break
        else:
            raise RuntimeError("the worker exited before it was ready:\n" + "".join(self.log))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def terminate(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Tally:
    """What happened to the requests; shared by the client threads."""

    outcomes: Counter[str] = field(default_factory=Counter)
    lost_examples: list[str] = field(default_factory=list)
    reject_ns: list[int] = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, *, tokens: int = 0, reject_ns: int = 0, why: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.tokens += tokens
            if reject_ns:
                self.reject_ns.append(reject_ns)
            if why and len(self.lost_examples) < 10:
                self.lost_examples.append(why)


def one_request(stub: Any, rng: random.Random, args: argparse.Namespace, tally: Tally) -> None:
    prompt = [rng.randrange(100, 1000) for _ in range(rng.randint(8, args.max_prompt))]
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True
        ),
    )
    started = time.perf_counter_ns()
    got, last = 0, None
    try:
        for message in stub.Generate(request, timeout=args.request_timeout):
            got += len(message.token_ids)
            last = message
    except grpc.RpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and got == 0:
            tally.add("rejected", reject_ns=time.perf_counter_ns() - started)
            time.sleep(args.backoff)
            return
        tally.add("lost", why=f"{code.name} after {got} tokens: {exc.details()}")
        return
    if (
        last is None
        or last.finish_reason != pb.FINISH_REASON_LENGTH
        or got != args.max_tokens
        or last.completion_tokens != args.max_tokens
    ):
        tally.add("lost", why=f"short answer: {got} tokens, last {last}")
        return
    tally.add("accepted", tokens=got)


def clients(stub: Any, args: argparse.Namespace, tally: Tally, stop: threading.Event) -> None:
    def loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            one_request(stub, rng, args, tally)
            with tally.lock:
                if tally.outcomes["accepted"] >= args.requests:
                    stop.set()

    threads = [
        threading.Thread(target=loop, args=(i,), daemon=True)
        for i in range(args.limit * args.overload)
    ]
    for thread in threads:
        thread.start()
    stop.wait(args.seconds)
    stop.set()
    for thread in threads:
        thread.join(args.request_timeout + 5)


def probe(channel: grpc.Channel, every: float, stop: threading.Event, out: list[int]) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    while not stop.is_set():
        started = time.perf_counter_ns()
        try:
            health.Check(request, timeout=5)
            out.append(time.perf_counter_ns() - started)
        except grpc.RpcError:
            out.append(5_000_000_000)  # a failed probe counts as the worst latency
        stop.wait(every)


def sampler(
    stub: Any, pid: int, started: float, stop: threading.Event, out: list[dict[str, Any]]
) -> None:
    while not stop.is_set():
        report = stub.CheckHealth(pb.CheckHealthRequest(), timeout=5)
        out.append(
            {
                "t_s": round(time.perf_counter() - started, 2),
                "running": int(report.num_running_requests),
                "kv_used_blocks": int(report.kv.used_blocks),
                "mlx_active_bytes": int(report.memory.active_bytes),
                "rss_bytes": rss_bytes(pid),
            }
        )
        stop.wait(1.0)


def memory_trend(samples: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Slope over the run after its first fifth (warm-up), in MiB per minute."""
    tail = samples[len(samples) // 5 :]
    xs = [s["t_s"] / 60 for s in tail]
    ys = [s[key] / MIB for s in tail]
    return {
        "first_mib": round(ys[0], 2) if ys else 0.0,
        "last_mib": round(ys[-1], 2) if ys else 0.0,
        "slope_mib_per_min": round(slope(xs, ys), 3),
    }


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    worker = WorkerProcess(model, args.limit, args.queued)
    tally = Tally()
    probes: list[int] = []
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    started = time.perf_counter()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
            with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as probe_channel:
                side = [
                    threading.Thread(
                        target=probe, args=(probe_channel, args.probe_every, stop, probes)
                    ),
                    threading.Thread(
                        target=sampler, args=(stub, worker.proc.pid, started, stop, samples)
                    ),
                ]
                for thread in side:
                    thread.start()
                log(f"{args.limit * args.overload} clients against a limit of {args.limit}")
                clients(stub, args, tally, stop)
                for thread in side:
                    thread.join(10)
        elapsed = time.perf_counter() - started
    finally:
        exit_code = worker.terminate(timeout=60)
    return {
        "seconds": round(elapsed, 1),
        "outcomes": dict(tally.outcomes),
        "lost_examples": tally.lost_examples,
        "generated_tokens": tally.tokens,
        "tokens_per_second": round(tally.tokens / elapsed, 1),
        "reject_ms": {
            "p50": round(percentile([v / 1e6 for v in tally.reject_ns], 50), 2),
            "p99": round(percentile([v / 1e6 for v in tally.reject_ns], 99), 2),
        },
        "health_ms": {
            "n": len(probes),
            "p50": round(percentile([v / 1e6 for v in probes], 50), 2),
            "p99": round(percentile([v / 1e6 for v in probes], 99), 2),
            "max": round(max(probes, default=0) / 1e6, 2),
        },
        "saturated_fraction": round(
            sum(s["running"] >= args.limit for s in samples) / max(len(samples), 1), 3
        ),
        "memory": {
            "rss": memory_trend(samples, "rss_bytes"),
            "mlx_active": memory_trend(samples, "mlx_active_bytes"),
        },
        "samples": samples,
        "worker_exit_code": exit_code,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the embedded SmolLM2)")
    p.add_argument("--limit", type=int, default=8, help="the worker's --max-running-requests")
    p.add_argument("--queued", type=int, default=8, help="the worker's --max-queued-steps")
    p.add_argument("--overload", type=int, default=3, help="clients per admitted request")
    p.add_argument("--requests", type=int, default=400, help="stop after this many accepted")
    p.add_argument("--seconds", type=float, default=120.0, help="stop after this long")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--backoff", type=float, default=0.1, help="wait after a rejection (s)")
    p.add_argument("--probe-every", type=float, default=0.02, help="health probe period (s)")
    p.add_argument("--health-p99-ms", type=float, default=100.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with temp_dir() as tmp:
        model = args.model or str(
            float32_copy(tmp, ensure_default_model(envs.cache_root(), show_progress=False))
        )
        result = run(args, model)
    outcomes = Counter(result["outcomes"])
    checks = {
        "no_request_lost": outcomes["lost"] == 0,
        "limit_reached_and_refused": outcomes["rejected"] > 0,
        "saturated_most_of_the_time": result["saturated_fraction"] >= 0.5,
        "health_p99_under_limit": result["health_ms"]["p99"] < args.health_p99_ms,
        "drained_cleanly": result["worker_exit_code"] == 0,
    }
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_facts(),
        "model": args.model or "embedded SmolLM2-135M-Instruct, float32 copy",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **result,
        "checks": checks,
        "pass": all(checks.values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{report['date']}-loadtest-{machine_name()}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    health, memory = result["health_ms"], result["memory"]
    print(
        f"{args.limit * args.overload} clients, limit {args.limit}, {result['seconds']} s: "
        f"accepted {outcomes['accepted']}, rejected {outcomes['rejected']} "
        f"(p99 {result['reject_ms']['p99']} ms), lost {outcomes['lost']}; "
        f"{result['tokens_per_second']} tok/s"
    )
    print(
        f"health check ({health['n']} probes, saturated {result['saturated_fraction'] * 100:.0f} % "
        f"of samples): p50 {health['p50']} ms, p99 {health['p99']} ms, max {health['max']} ms"
    )
    print(
        f"memory after warm-up: RSS {memory['rss']['first_mib']} -> "
        f"{memory['rss']['last_mib']} MiB "
        f"({memory['rss']['slope_mib_per_min']:+} MiB/min), MLX active "
        f"{memory['mlx_active']['first_mib']} -> {memory['mlx_active']['last_mib']} MiB "
        f"({memory['mlx_active']['slope_mib_per_min']:+} MiB/min); worker exit "
        f"{result['worker_exit_code']} after SIGTERM"
    )
    for example in result["lost_examples"]:
        print(f"  lost: {example}")
    failed = [name for name, ok in checks.items() if not ok]
    print(f"{'PASS' if report['pass'] else 'FAIL'}" + (f": {', '.join(failed)}" if failed else ""))
    print(f"wrote {path}")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
