"""`make bench-gateway`: the OpenAI gateway against `mlx_lm.server`, the same chat workload.

Both servers serve the embedded SmolLM2 model (what `make serve` serves) on this
machine, as users run them: a `mlx-worker serve --auto-init` process behind a
`mlx-worker gateway` process, and one `mlx_lm.server` process on the same model
directory. Both are started first and stay up (an idle one uses no CPU) and answer
one untimed round of other prompts at the highest concurrency.

At concurrency c (1, 4, 8 by default), c clients each send streamed chat
completions one after the other (greedy, `--max-tokens` tokens at most,
`stream_options.include_usage`), every request its own prompt: `--rounds` each,
and at least `--min-requests` in all. A level runs in two halves, in the order
gateway, mlx_lm.server, then mlx_lm.server, gateway (ABBA), each half with the same
prompts on both, so a drift in the machine's load (other users) does not favour one
side. Tokens/s is every completion token (from `usage`) over the wall time the side
spent; time to first token (TTFT) is from sending a request to its first chunk with
content. The CPU seconds each side's processes used per completion token are
recorded too: on a shared machine they move less than wall times. The JSON
(benchmarks/results/<date>-<machine>-gateway.json) has every figure and the ratios
gateway / mlx_lm.server the issue sets targets on: throughput >= 1.0, TTFT <= 1.1.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import machine_facts, machine_name, percentile, ratio, temp_dir
from benchmarks.fleet import ServerProcess, cpu_seconds, cpu_used, worker_processes
from mlx_worker_svc.cli import envs
from mlx_worker_svc.engine.model.embedded import ensure_default_model

RESULTS = Path(__file__).resolve().parent / "results"
GATEWAY, MLX_LM = "gateway", "mlx_lm.server"
THROUGHPUT_TARGET, TTFT_TARGET = 1.0, 1.1
_SUBJECTS = ["a lighthouse keeper", "a lost robot", "a city of bees", "an old violin"]
_SUBJECTS += ["a desert train", "a moon garden", "a shy dragon", "a river that sang"]
_SUBJECTS += ["a clockmaker's cat", "a forgotten island"]
_FORMS = ["Write a short story about", "Describe", "Write a poem about", "Tell a fable about"]


def chat_prompts(count: int) -> list[str]:
    """`count` distinct chat prompts of similar length."""
    prompts = [f"{form} {subject}." for form in _FORMS for subject in _SUBJECTS]
    if count > len(prompts):
        raise ValueError(f"at most {len(prompts)} distinct prompts")
    return prompts[:count]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_healthy(url: str, proc: ServerProcess) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never became healthy:\n{proc.log.read_text()}")


@contextmanager
def servers(model: Path, tmp: Path) -> Iterator[dict[str, tuple[str, list[ServerProcess]]]]:
    """Both stacks, up: {name: (base URL, its processes)}."""
    with ExitStack() as stack:
        port = _free_port()
        mlx = ServerProcess(
            ["server", "--model", str(model), "--port", str(port)],
            tmp / "mlx_lm_server.log",
            module="mlx_lm",
        )
        stack.callback(mlx.stop)
        [worker] = stack.enter_context(worker_processes(model, 1, tmp))
        gateway = ServerProcess(
            ["gateway", "--worker", worker.target, "--port", "0"], tmp / "gateway.log"
        )
        stack.callback(gateway.stop)
        gateway_port = gateway.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1)
        urls = {GATEWAY: f"http://127.0.0.1:{gateway_port}", MLX_LM: f"http://127.0.0.1:{port}"}
        _wait_healthy(urls[GATEWAY], gateway)
        _wait_healthy(urls[MLX_LM], mlx)
        yield {GATEWAY: (urls[GATEWAY], [worker, gateway]), MLX_LM: (urls[MLX_LM], [mlx])}


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streamed chat completion: (TTFT in seconds, completion tokens)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = 0.0, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            choices = chunk.get("choices") or [{}]
            if not ttft and (choices[0].get("delta") or {}).get("content"):
                ttft = time.perf_counter() - start
    if not tokens or not ttft:
        raise RuntimeError(f"no usage or no content for {prompt!r}")
    return ttft, tokens


async def _level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> Tally:
    """`concurrency` clients share `prompts`, each sending one request after another."""
    queue = list(reversed(prompts))
    tally = Tally()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:

        async def user() -> None:
            while queue:
                ttft, tokens = await _one(client, queue.pop(), max_tokens)
                tally.ttfts.append(ttft)
                tally.tokens += tokens

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        tally.wall = time.perf_counter() - start
    return tally


@dataclass
class Tally:
    """What one side did at one level: TTFTs, tokens, wall and CPU seconds."""

    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0

    def add(self, other: Tally) -> None:
        self.ttfts += other.ttfts
        self.tokens += other.tokens
        self.wall += other.wall
        self.cpu += other.cpu

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.ttfts),
            "completion_tokens": self.tokens,
            "wall_s": round(self.wall, 3),
            "tokens_per_s": round(self.tokens / self.wall, 3),
            "ttft_mean_s": round(statistics.fmean(self.ttfts), 3),
            "ttft_p50_s": round(percentile(self.ttfts, 50), 3),
            "ttft_max_s": round(max(self.ttfts), 3),
            "cpu_s": round(self.cpu, 2),
            "cpu_ms_per_token": round(1000 * self.cpu / self.tokens, 1),
        }


def _measured(url: str, procs: list[ServerProcess], prompts: list[str], c: int, n: int) -> Tally:
    """One half-level on one side, with the CPU seconds its processes used."""
    pids = {p.log.stem: p.proc.pid for p in procs}
    before = {key: cpu_seconds(pid) for key, pid in pids.items()}
    tally = asyncio.run(_level(url, prompts, c, n))
    tally.cpu = sum(v or 0.0 for v in cpu_used(pids, before).values())
    return tally


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [c * max(args.rounds, -(-args.min_requests // c)) for c in levels]
    prompts = chat_prompts(sum(counts) + max(levels))
    warm, rest = prompts[: max(levels)], prompts[max(levels) :]
    model = ensure_default_model(envs.cache_root(), show_progress=True)
    started = time.monotonic()
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_facts(),
        "model": str(model),
        "options": {k: v for k, v in vars(args).items() if k != "out"},
        "levels": [],
    }
    with temp_dir() as tmp, servers(model, tmp) as stacks:
        for url, _ in stacks.values():
            asyncio.run(_level(url, warm, len(warm), 8))
        for concurrency, count in zip(levels, counts, strict=True):
            batch, rest = rest[:count], rest[count:]
            tallies = {GATEWAY: Tally(), MLX_LM: Tally()}
            halves = [batch[: count // 2], batch[count // 2 :]]
            for half, order in zip(halves, ([GATEWAY, MLX_LM], [MLX_LM, GATEWAY]), strict=True):
                for name in order:
                    url, procs = stacks[name]
                    tallies[name].add(_measured(url, procs, half, concurrency, args.max_tokens))
            level: dict[str, Any] = {"concurrency": concurrency}
            level |= {name: tally.summary() for name, tally in tallies.items()}
            gw, base = level[GATEWAY], level[MLX_LM]
            level["throughput_ratio"] = ratio(gw["tokens_per_s"], base["tokens_per_s"])
            level["ttft_ratio"] = ratio(gw["ttft_mean_s"], base["ttft_mean_s"])
            level["cpu_per_token_ratio"] = ratio(gw["cpu_ms_per_token"], base["cpu_ms_per_token"])
            level["meets_targets"] = (level["throughput_ratio"] or 0) >= THROUGHPUT_TARGET and (
                level["ttft_ratio"] or 0
            ) <= TTFT_TARGET
            print(f"c={concurrency}: {level}", flush=True)
            out["levels"].append(level)
    out["run_seconds"] = round(time.monotonic() - started, 1)
    return out


def table(results: dict[str, Any]) -> str:
    rows = [
        "| concurrency | gateway tok/s | mlx_lm.server tok/s | ratio (>= 1.0) "
        "| gateway TTFT s | mlx_lm.server TTFT s | ratio (<= 1.1) "
        "| CPU ms/token, gateway / mlx_lm.server |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in results["levels"]:
        gw, base = level[GATEWAY], level[MLX_LM]
        rows.append(
            f"| {level['concurrency']} | {gw['tokens_per_s']:.2f} | {base['tokens_per_s']:.2f} "
            f"| {level['throughput_ratio']} | {gw['ttft_mean_s']:.3f} | {base['ttft_mean_s']:.3f} "
            f"| {level['ttft_ratio']} | {gw['cpu_ms_per_token']} / {base['cpu_ms_per_token']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,8", help="levels (default 1,4,8)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    parser.add_argument(
        "--min-requests", type=int, default=4, help="requests per level at least (default 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (default 32)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args()
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{results['date']}-{machine_name()}-gateway.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(table(results))
    verdict = all(level["meets_targets"] for level in results["levels"])
    print(f"\ntargets met at every level: {verdict}; run {results['run_seconds']} s; wrote {path}")


if __name__ == "__main__":
    main()
