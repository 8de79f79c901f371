"""The `mlx-worker` command line: `serve`, `convert-gguf`, `fleet` and `generate`.

`serve` starts the gRPC worker (health answers at once; with --auto-init the
worker also runs its own lifecycle so Generate works without a scheduler).
With `--world-size N` it starts a worker group through `mlx.launch`
(group_launch.py); `--group` is how each of the group's processes starts.
`convert-gguf` turns a llama GGUF file into an MLX model directory, or, with
no file, builds the embedded default model (SmolLM2-135M-Instruct).
`fleet`, `gateway` and `generate` drive workers through the fleet scheduler (fleet.py).
`serve`, `fleet` and `gateway` also read their flags from `--config FILE` (config_file.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.log_format import add_logging_arguments, configure_logging

if TYPE_CHECKING:
    from mlx_worker_svc.core.limits import AdmissionLimits
    from mlx_worker_svc.engine.group.channel import GroupChannel
    from mlx_worker_svc.rpc.security import SecurityConfig
    from mlx_worker_svc.rpc.server import WorkerServer


def _join_group(args: argparse.Namespace) -> GroupChannel:
    """Joins the group mlx.launch started; every rank says who it is."""
    import socket

    from mlx_worker_svc.cli.group_launch import RANK_LINE, init_backend, launched_backend
    from mlx_worker_svc.engine.group.channel import join

    backend = args.backend or launched_backend()
    channel = join(init_backend(backend), backend, args.collective_timeout)
    print(
        RANK_LINE.format(
            rank=channel.rank,
            size=channel.size,
            backend=backend,
            pid=os.getpid(),
            host=socket.gethostname(),
        ),
        flush=True,
    )
    return channel


def _serve(args: argparse.Namespace) -> int:
    # A fatal signal (a native crash, an abort) prints every thread's Python stack.
    faulthandler.enable()
    status = _serve_status(args)
    _end_process(status)


def _end_process(status: int) -> NoReturn:
    """Ends a serve process once its work is done: logs and output flushed, then `os._exit`.

    By now nothing is left to release (the engine thread is joined, the server
    stopped, the group told). Interpreter teardown would still run the native
    destructors of gRPC core and of MLX's per-thread streams, and those have
    been seen to abort a process that had drained cleanly ("terminate called
    without an active exception", SIGABRT, once in a CI run), which a
    supervisor reads as a crash.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve_status(args: argparse.Namespace) -> int:
    from mlx_worker_svc.cli.security_flags import server_security_from_args
    from mlx_worker_svc.core.errors import WorkerError
    from mlx_worker_svc.core.limits import AdmissionLimits
    from mlx_worker_svc.rpc.security import SecurityError

    try:  # before anything slow: an unsafe or broken setup exits at once
        security = server_security_from_args(args)
    except SecurityError as exc:
        print(f"mlx-worker serve: {exc}", file=sys.stderr, flush=True)
        return 2
    from mlx_worker_svc.cli.engine_flags import kv_format

    try:
        kv_format(args)
    except WorkerError as exc:
        print(f"mlx-worker serve: {exc.message}", file=sys.stderr, flush=True)
        return 2
    model = args.model
    if model is None:
        from mlx_worker_svc.cli.envs import cache_root
        from mlx_worker_svc.engine.model.embedded import ensure_default_model

        model = str(ensure_default_model(cache_root(), show_progress=True))
    try:
        limits = AdmissionLimits(
            max_running_requests=args.max_running_requests,
            max_queued_steps=args.max_queued_steps,
            max_steps_in_flight=args.max_steps_in_flight,
        )
    except WorkerError as exc:
        print(f"mlx-worker serve: {exc.message}", file=sys.stderr, flush=True)
        return 2
    if args.world_size > 1 and not args.group:
        from mlx_worker_svc.cli.group_launch import run_group

        return run_group(args, args.argv)
    if not args.group:
        return _serve_worker(args, model, limits, security, None)
    # Import the worker before joining: once joined, the other ranks wait for
    # rank 0 in a collective, which keeps a core busy.
    import mlx_worker_svc.engine.group.replica
    import mlx_worker_svc.rpc.server  # noqa: F401

    group = _join_group(args)
    if args.world_size not in (0, group.size):
        print(
            f"mlx-worker serve: --world-size is {args.world_size} but mlx.launch started "
            f"{group.size} processes",
            file=sys.stderr,
            flush=True,
        )
        status = 2
    elif group.rank != 0:
        from mlx_worker_svc.cli.engine_flags import engine_options
        from mlx_worker_svc.engine.group.replica import follow

        return follow(group, engine_options(args))
    else:
        status = _serve_worker(args, model, limits, security, group)
    if group.rank == 0:
        from mlx_worker_svc.cli.group_launch import EXIT_LINE

        print(EXIT_LINE.format(status=status), flush=True)
    return status


def _serve_worker(
    args: argparse.Namespace,
    model: str,
    limits: AdmissionLimits,
    security: SecurityConfig,
    group: GroupChannel | None,
) -> int:
    """Serves gRPC (alone, or as rank 0 of `group`) until the server stops."""
    from mlx_worker_svc.cli.engine_flags import engine_options, kv_format
    from mlx_worker_svc.core.limits import context_hint
    from mlx_worker_svc.engine.profiler import profile_directory
    from mlx_worker_svc.rpc.security import SecurityError
    from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer
    from mlx_worker_svc.worker.bring_up import BringUp, bring_up

    try:
        profile_dir = profile_directory(args.profile_dir) if args.profile_dir else None
    except ValueError as exc:
        print(f"mlx-worker serve: {exc}", file=sys.stderr, flush=True)
        return 2
    config = ServerConfig(
        host=args.host,
        port=args.port,
        grace_seconds=args.grace_seconds,
        limits=limits,
        max_context_tokens=context_hint(model, args.max_model_len),
        death_exit_seconds=args.death_exit_seconds,
        security=security,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        engine=engine_options(args),
        profile_dir=profile_dir,
    )
    server = WorkerServer(config, group=group)
    if args.auto_init:
        # Before the port opens: CheckHealth says bringing_up from its first answer.
        server.worker.lifecycle.claim()
    _exit_after_engine_death(server, args.death_exit_seconds, group is not None)
    try:
        port = server.start()
    except (OSError, SecurityError) as exc:
        logging.error("%s", exc)
        return 2
    server.install_signal_handlers()
    print(f"mlx-worker listening on {args.host}:{port}", flush=True)
    if server.metrics_port:
        print(f"mlx-worker metrics on {args.metrics_host}:{server.metrics_port}", flush=True)
    if args.auto_init:
        plan = BringUp(
            model=model,
            device=DeviceKind(args.device),
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            memory_utilization=args.memory_utilization,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            prefix_caching=not args.no_prefix_caching,
            memory_limit_bytes=args.memory_limit_bytes,
            kv=kv_format(args),
        )
        try:
            up = bring_up(server.worker, plan)
        except Exception as exc:
            if server.draining:  # SIGTERM or Shutdown during start-up: not a failure
                logging.info("start-up stopped by the shutdown: %s", exc)
                server.wait()
                return 0
            logging.error("auto-init failed: %s", exc)
            server.shutdown(grace_seconds=1.0, abort=True)
            server.wait()
            return 1
        print(
            f"ready: {up.model.model_type} from {up.model.model_path} on {up.device.name} "
            f"({up.device.kind.value}), {up.cache.num_blocks} KV blocks of "
            f"{up.profile.block_size} tokens, prefix cache "
            f"{'on' if up.cache.prefix_caching else 'off'}, "
            f"memory limit {up.cache.memory_limit_bytes / 2**30:.1f} GiB, "
            f"{up.cache.kv.describe()} KV",
            flush=True,
        )
    server.wait()
    if server.engine_died.is_set():
        logging.critical("exiting: the engine thread died (%s)", server.worker.engine_dead)
        return 3
    return 0


def _exit_after_engine_death(server: WorkerServer, seconds: float, group: bool) -> None:
    """Ends the process (exit status 3) `seconds` after the engine dies, whatever hangs."""

    def watch() -> None:
        server.engine_died.wait()
        time.sleep(seconds)
        logging.critical("the engine died %.1fs ago and the server has not stopped: exit", seconds)
        if group:
            from mlx_worker_svc.cli.group_launch import EXIT_LINE

            print(EXIT_LINE.format(status=3), flush=True)
        os._exit(3)

    threading.Thread(target=watch, name="death-watch", daemon=True).start()


def _convert(args: argparse.Namespace) -> int:
    if args.gguf is None:
        from mlx_worker_svc.cli.envs import cache_root
        from mlx_worker_svc.engine.model.embedded import ensure_default_model

        print(ensure_default_model(cache_root(), show_progress=True))
        return 0
    if args.out is None:
        print("convert-gguf: --out is required with a GGUF file", file=sys.stderr)
        return 2
    from mlx_worker_svc.engine.model.gguf import convert_gguf

    def progress(stage: str, fraction: float) -> None:
        print(f"\r{stage}: {fraction * 100:5.1f}%", end="", file=sys.stderr, flush=True)

    out = convert_gguf(Path(args.gguf), Path(args.out), progress=progress)
    print(file=sys.stderr)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mlx_worker_svc.core.limits import (
        DEFAULT_MAX_QUEUED_STEPS,
        DEFAULT_MAX_RUNNING_REQUESTS,
        DEFAULT_MAX_STEPS_IN_FLIGHT,
    )

    parser = argparse.ArgumentParser(prog="mlx-worker", description=__doc__.split("\n\n")[0])
    add_logging_arguments(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the gRPC worker")
    serve.add_argument(
        "--model", help="model directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs TLS, a token or --insecure)",
    )
    serve.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 = any)")
    serve.add_argument(
        "--auto-init",
        action="store_true",
        help="run InitDevice..WarmUp at start so Generate works at once",
    )
    serve.add_argument(
        "--max-loaded-models",
        type=_max_loaded_models,
        default=1,
        metavar="N",
        help="models the worker holds at once: 1, the only value (LoadModel replaces the "
        "model; a fleet with --models swaps models between workers, docs/fleet.md)",
    )
    serve.add_argument("--device", choices=[k.value for k in DeviceKind], default="auto")
    serve.add_argument("--max-model-len", type=int, default=0, help="cap the context length")
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="profiling size for auto-init (default: DetermineMemory's device default, 32 on "
        "CPU and 2048 on GPU)",
    )
    serve.add_argument("--memory-utilization", type=float, default=0.9)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument(
        "--num-blocks", type=int, default=0, help="KV blocks for auto-init (default: suggested)"
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="auto-init without the prefix cache (default: on where the model allows it)",
    )
    serve.add_argument(
        "--memory-limit-bytes",
        type=int,
        default=0,
        help="auto-init memory limit (default: derived from the budget, see the proto)",
    )
    serve.add_argument(
        "--grace-seconds", type=float, default=30.0, help="drain time on SIGTERM (default 30)"
    )
    serve.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="live requests admitted; past it RESOURCE_EXHAUSTED at once "
        f"(default {DEFAULT_MAX_RUNNING_REQUESTS})",
    )
    serve.add_argument(
        "--max-queued-steps",
        type=int,
        default=DEFAULT_MAX_QUEUED_STEPS,
        help="Execute steps and Generate starts waiting for the engine; past it "
        f"RESOURCE_EXHAUSTED at once (default {DEFAULT_MAX_QUEUED_STEPS})",
    )
    serve.add_argument(
        "--max-steps-in-flight",
        type=int,
        default=DEFAULT_MAX_STEPS_IN_FLIGHT,
        help="steps of one ExecuteStream read ahead of their responses "
        f"(default {DEFAULT_MAX_STEPS_IN_FLIGHT})",
    )
    serve.add_argument(
        "--death-exit-seconds",
        type=float,
        default=10.0,
        help="if the engine thread dies, exit (status 3) within this time (default 10)",
    )
    serve.add_argument(
        "--profile-dir",
        metavar="DIR",
        help="turn on StartProfile/StopProfile, which write cProfiles of the engine thread "
        "(and Metal GPU captures) under DIR, created if missing (default: off)",
    )
    _add_group_arguments(serve)
    from mlx_worker_svc.cli.config_file import add_config_arguments
    from mlx_worker_svc.cli.engine_flags import add_engine_arguments, add_kv_arguments
    from mlx_worker_svc.cli.security_flags import add_server_arguments
    from mlx_worker_svc.rpc.metrics import add_metrics_arguments

    add_server_arguments(serve)
    add_metrics_arguments(serve)
    add_engine_arguments(serve)
    add_kv_arguments(serve, "auto-init")
    add_config_arguments(serve)
    serve.set_defaults(func=_serve)

    convert = sub.add_parser(
        "convert-gguf", help="convert a llama GGUF file (default: build the embedded model)"
    )
    convert.add_argument("gguf", nargs="?", help="GGUF file (omit to build the default model)")
    convert.add_argument("--out", help="output model directory")
    convert.set_defaults(func=_convert)

    from mlx_worker_svc.cli.fleet import add_commands

    add_commands(sub)
    for command in sub.choices.values():
        add_logging_arguments(command, defaults=False)
    return parser


def _add_group_arguments(serve: argparse.ArgumentParser) -> None:
    from mlx_worker_svc.cli.group_launch import BACKENDS
    from mlx_worker_svc.engine.group.channel import DEFAULT_TIMEOUT

    group = serve.add_argument_group("worker groups (see README: Worker groups)")
    group.add_argument(
        "--world-size",
        type=int,
        default=0,
        help="start a group of N processes through mlx.launch (N ranks on this machine, or "
        "the hosts of --hostfile); rank 0 serves gRPC",
    )
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help="mx.distributed backend (default: the --hostfile's, else ring; with --group, the "
        "one mlx.launch started)",
    )
    group.add_argument("--hostfile", help="mlx.launch hostfile: the machines of the group")
    group.add_argument(
        "--group-port", type=int, default=0, help="ring backend: first port (default: a free one)"
    )
    group.add_argument(
        "--collective-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="a group step that does not finish in this time breaks the group "
        f"(default {DEFAULT_TIMEOUT:.0f}; lifecycle calls get 20x)",
    )
    group.add_argument(
        "--group",
        action="store_true",
        help="this process is one rank of a group started by mlx.launch",
    )


def _max_loaded_models(text: str) -> int:
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(
            f"must be 1, got {text}: a worker holds one model at a time; to serve several, "
            "run a fleet with --models NAME=PATH, which loads them on its workers on demand"
        )
    return 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line's arguments, a `--config` file's read first (flags win over it)."""
    from mlx_worker_svc.cli.config_file import apply_config

    parser = build_parser()
    apply_config(parser, argv)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    configure_logging(args.log_level, args.log_format)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
