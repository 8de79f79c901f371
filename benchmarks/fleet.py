"""Section (g): fleet throughput, 1 worker and 2 workers on one machine.

Worker processes (`mlx-worker serve --auto-init`) sit behind a fleet process
(`mlx-worker fleet`), as an operator would run them; the client sends `requests`
concurrent greedy requests (distinct prompts, EOS ignored, `tokens` tokens each)
through `FleetService.Generate`, one thread per stream, and measures completed
tokens per second: every token of every request over the wall time from the first
request sent to the last stream ended. The same work runs against a fleet of one
worker and a fleet of two (the workers are started once; the one-worker fleet uses
the first). Each fleet first runs one untimed round of other prompts with the same
shapes, so every fleet is warm, and then measures a round of prompts of its own
(the same lengths and token counts), so that no fleet finds its prompts in a
worker's prefix cache from an earlier fleet's round.

Each fleet drives its workers through ExecuteStream, one step ahead (the default);
the one-worker fleet runs once more through unary Execute (`--steps-ahead 0`), so
`ratio_stream_vs_unary` compares the two on the same worker and requests. With
`repeats` > 1 every fleet runs that many times, interleaved (each time a fresh
fleet process on the same workers, with a round of its own), and the ratio and
the per-fleet figures take each fleet's best round, as section (i) does: on a
small shared CPU a single round moves by a fifth from one run to the next.
With `baseline` (a checkout of another version of this project, e.g. from
`git worktree add DIR REV`), that version's own worker and fleet processes run
one worker's rounds too, interleaved with the others, each with its fleet's
defaults, so `ratio_vs_baseline` compares this fleet's default (one worker)
with that version's default on the same machine, client and prompts.
Every process here shares the machine's cores (`cpu_count`): workers, fleet and
client. On a 2-core CPU two workers cannot be twice as fast as one; `cpu_s` gives
the CPU seconds each process used during the measured round (Linux), which shows
where the cores went.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO

import grpc

from benchmarks.common import ratio
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2, fleet_pb2_grpc
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

_READY_S = 300.0


class ServerProcess:
    """A `python -m MODULE ...` subprocess (default: mlx_worker_svc) writing to a log file."""

    def __init__(
        self, args: list[str], log: Path, *, module: str = "mlx_worker_svc", cwd: Path | None = None
    ) -> None:
        """`cwd`: run the module of the checkout there (`-m` imports from it first)."""
        self.log = log
        self.target = ""
        self._out: TextIO = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
        )

    def wait_for(self, pattern: str) -> re.Match[str]:
        deadline = time.monotonic() + _READY_S
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text(), re.MULTILINE)
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.log.name}: no {pattern!r}:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._out.close()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_used(pids: dict[str, int], before: dict[str, float | None]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        now, then = cpu_seconds(pid), before.get(name)
        out[name] = None if now is None or then is None else round(now - then, 2)
    return out


@contextmanager
def worker_processes(
    model: Path, count: int, tmp: Path, *, checkout: Path | None = None
) -> Iterator[list[ServerProcess]]:
    """`count` worker processes on the model, lifecycle done; yields them (`target` set).

    `checkout`: processes of the project's version there (`ServerProcess`'s `cwd`).
    """
    with ExitStack() as stack:
        procs: list[ServerProcess] = []
        for i in range(count):
            proc = ServerProcess(
                ["serve", "--model", str(model), "--auto-init", "--port", "0"],
                tmp / f"worker-{'base-' if checkout else ''}{i}.log",
                cwd=checkout,
            )
            stack.callback(proc.stop)
            procs.append(proc)
        for proc in procs:
            port = proc.wait_for(r"listening on [\d.]+:(\d+)").group(1)
            proc.wait_for(r"^ready:")
            proc.target = f"127.0.0.1:{port}"
        yield procs


@contextmanager
def _fleet(
    targets: list[str], tmp: Path, steps_ahead: int | None, checkout: Path | None = None
) -> Iterator[tuple[Any, ServerProcess]]:
    """A fleet process in front of `targets`; yields a stub to it once all are up.

    `steps_ahead` None: the fleet's default; `checkout`: the version there.
    """
    workers = [arg for target in targets for arg in ("--worker", target)]
    args = ["fleet", *workers, "--port", "0"]
    if steps_ahead is not None:
        args += ["--steps-ahead", str(steps_ahead)]
    name = f"fleet-{len(targets)}-{'base' if checkout else steps_ahead}.log"
    proc = ServerProcess(args, tmp / name, cwd=checkout)
    try:
        port = proc.wait_for(r"fleet listening on [\d.]+:(\d+)").group(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)  # type: ignore[no-untyped-call]
            deadline = time.monotonic() + _READY_S
            while not all(w.up for w in stub.Status(fleet_pb2.StatusRequest()).workers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fleet: workers not up\n{proc.log.read_text()}")
                time.sleep(0.1)
            yield stub, proc
    finally:
        proc.stop()


def _round(stub: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """All prompts at once, one thread per stream; completed tokens over the wall time."""
    params = pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    counts = [0] * len(prompts)
    ttft = [0.0] * len(prompts)
    errors: list[str] = []
    start = time.perf_counter()

    def one(i: int) -> None:
        request = pb.GenerateRequest(prompt_token_ids=prompts[i], sampling_params=params)
        try:
            for message in stub.Generate(request, timeout=1800):
                if message.token_ids and not counts[i]:
                    ttft[i] = time.perf_counter() - start
                counts[i] += len(message.token_ids)
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors or any(c != tokens for c in counts):
        raise RuntimeError(f"fleet round failed: {errors or counts}")
    return {
        "wall_s": round(wall, 3),
        "completed_tokens": sum(counts),
        "tok_s": round(sum(counts) / wall, 2),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
    }


# The steps ahead of the baseline checkout's fleet: its own default, whatever it is.
_BASELINE = -1


def fleet_variants(worker_counts: list[int], baseline: bool = False) -> list[tuple[int, int]]:
    """(workers, steps ahead) of each measured fleet, in the order they run.

    Every count through ExecuteStream one step ahead (the default); one worker
    also through unary Execute, one step at a time (--steps-ahead 0), for the
    comparison, and with `baseline`, through the baseline checkout's fleet
    (steps ahead `_BASELINE`: its own default).
    """
    one = min(worker_counts)
    variants = [(count, 1) for count in worker_counts] + [(one, 0)]
    return [*variants, (one, _BASELINE)] if baseline else variants


def fleet_rounds(worker_counts: list[int], repeats: int, baseline: bool = False) -> int:
    """Prompt rounds section_g needs: one warm-up round and one per measured run."""
    return 1 + len(fleet_variants(worker_counts, baseline)) * repeats


def _label(ahead: int) -> str:
    return {0: "unary", _BASELINE: "baseline"}.get(ahead, f"stream, {ahead} step ahead")


def _best_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fleet's (workers, execute) fastest round, in the order fleets first ran."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for run in runs:
        key = (run["workers"], run["execute"])
        if key not in best or run["tok_s"] > best[key]["tok_s"]:
            best[key] = run
    return list(best.values())


def section_g(
    model: Path,
    prompts: list[list[int]],
    tokens: int,
    worker_counts: list[int],
    tmp: Path,
    *,
    repeats: int = 1,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """`prompts` holds `fleet_rounds(worker_counts, repeats, baseline)` rounds: the
    first warms every fleet, and each fleet's run measures a round of its own, so
    that no fleet finds its prompts in a worker's prefix cache from an earlier one."""
    kinds = fleet_variants(worker_counts, baseline is not None)
    size = len(prompts) // fleet_rounds(worker_counts, repeats, baseline is not None)
    warm = prompts[:size]
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        workers = stack.enter_context(worker_processes(model, max(worker_counts), tmp))
        base_workers = []
        if baseline is not None:
            base_workers = stack.enter_context(
                worker_processes(model, min(worker_counts), tmp, checkout=baseline)
            )
        for n, (count, ahead) in enumerate(kinds * repeats, start=1):
            measured = prompts[n * size : (n + 1) * size]
            base = ahead == _BASELINE
            chosen = (base_workers if base else workers)[:count]
            fleet_of = _fleet(
                [w.target for w in chosen], tmp, None if base else ahead, baseline if base else None
            )
            with fleet_of as (stub, fleet):
                _round(stub, warm, tokens)
                pids = {"fleet": fleet.proc.pid}
                pids.update({f"worker_{i}": w.proc.pid for i, w in enumerate(chosen)})
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                client = time.process_time()
                run = _round(stub, measured, tokens)
                cpu = cpu_used(pids, before)
                cpu["client"] = round(time.process_time() - client, 2)
                status = stub.Status(fleet_pb2.StatusRequest())
            run["workers"] = count
            run["execute"] = _label(ahead)
            run["repeat"] = (n - 1) // len(kinds)
            # CPU seconds each process used during the measured round (None: no /proc).
            run["cpu_s"] = cpu
            # Requests each worker finished, warm-up round included.
            run["finished_per_worker"] = [int(w.num_finished) for w in status.workers]
            runs.append(run)
    best = _best_runs(runs)
    streamed = [r for r in best if r["execute"].startswith("stream")]
    one = next((r for r in streamed if r["workers"] == 1), None)
    for run in streamed:
        run["speedup_vs_1_worker"] = ratio(run["tok_s"], one["tok_s"]) if one else None
    unary = next(r for r in best if r["execute"] == "unary")
    same = next(r for r in streamed if r["workers"] == unary["workers"])
    unary["speedup_vs_1_worker"] = None
    result = {
        "model": str(model),
        "requests": len(measured),
        "tokens_per_request": tokens,
        "prompt_tokens": len(measured[0]),
        "cpu_count": os.cpu_count(),
        "repeats": repeats,
        # Each fleet's best round (the figures the ratios use), in fleet_variants' order.
        "runs": best,
        # Every measured round, in the order run (`repeat` counts from 0).
        "all_runs": runs,
        "ratio_stream_vs_unary": ratio(same["tok_s"], unary["tok_s"]),
    }
    if baseline is not None:
        old = next(r for r in best if r["execute"] == "baseline")
        old["speedup_vs_1_worker"] = None
        result["baseline"] = {"checkout": str(baseline), "commit": _commit(baseline)}
        result["ratio_vs_baseline"] = ratio(same["tok_s"], old["tok_s"])
        result["target_ratio_vs_baseline"] = 1.3
    return result


def _commit(checkout: Path) -> str:
    """The commit checked out at `checkout` ("" where git cannot tell)."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else ""
