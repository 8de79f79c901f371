"""`make demo`: start a worker, stream one chat answer through Generate, stop it.

Runs the real thing end to end: a worker process on a free loopback port with
the embedded model (`serve --auto-init`), a gRPC client that streams the answer
to the terminal as it is generated, and a Shutdown RPC that drains the worker.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import grpc

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


def _start(model: str | None) -> tuple[subprocess.Popen[str], int]:
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--auto-init", "--port", "0"]
    if model:
        command += ["--model", model]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = 0
    for line in proc.stdout:
        print(f"[worker] {line.rstrip()}", file=sys.stderr)
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match:
            port = int(match.group(1))
        if line.startswith("ready:"):
            return proc, port
    raise SystemExit(f"the worker exited before it was ready (exit code {proc.wait()})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    proc, port = _start(args.model)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=args.question)],
                sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
            )
            print(f"> {args.question}")
            start = time.perf_counter()
            last = None
            for message in stub.Generate(request):
                print(message.text, end="", flush=True)
                last = message
            seconds = time.perf_counter() - start
            if last is not None:
                reason = pb.FinishReason.Name(last.finish_reason)
                print(
                    f"\n[{last.completion_tokens} tokens in {seconds:.1f}s, {reason}]",
                    file=sys.stderr,
                )
            stub.Shutdown(pb.ShutdownRequest(grace_seconds=5))
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
