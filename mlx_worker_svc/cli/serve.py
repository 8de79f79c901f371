"""The `serve` runtime: a worker process from its flags to its exit status.

`serve` checks the flags that can fail at once (security, KV format, limits,
adapters), then serves one worker, starts a worker group through `mlx.launch`
(group_launch.py), or joins one as a rank (`--group`); with `--auto-init` the
worker brings itself up (worker/bring_up.py). The process ends through
`_end_process` (flushed, then `os._exit`), and exits 3 within
`--death-exit-seconds` of an engine death whatever hangs.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from mlx_worker_svc.cli.config_file import usage_error
from mlx_worker_svc.core.domain import DeviceKind

if TYPE_CHECKING:
    from mlx_worker_svc.core.limits import AdmissionLimits
    from mlx_worker_svc.engine.group.channel import GroupChannel
    from mlx_worker_svc.rpc.security import SecurityConfig
    from mlx_worker_svc.rpc.server import WorkerServer


def _join_group(args: argparse.Namespace) -> GroupChannel:
    """Joins the group mlx.launch started; every rank says who it is."""
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


def serve(args: argparse.Namespace) -> int:
    """`mlx-worker serve`: runs the worker (or a group's rank) and ends the process."""
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
        return usage_error(args, exc)
    from mlx_worker_svc.cli.engine_flags import engine_options, kv_format

    try:
        kv_format(args)
    except WorkerError as exc:
        return usage_error(args, exc.message)
    problem = _flag_problem(args)
    if problem:
        return usage_error(args, problem)
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
        return usage_error(args, exc.message)
    try:
        engine_options(args)
    except ValueError as exc:
        return usage_error(args, exc)
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
        return usage_error(args, exc)
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
        print(f"mlx-worker serve: {exc}", file=sys.stderr, flush=True)
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
            f"memory limit {_size(up.cache.memory_limit_bytes)}, "
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


def _flag_problem(args: argparse.Namespace) -> str:
    """Why flags that parse cannot work together ("" when they can)."""
    from mlx_worker_svc.cli.engine_flags import named_twice

    if args.group and not _launched():
        return (
            "--group is for the ranks mlx.launch starts (it sets MLX_RANK and MLX_HOSTFILE, "
            "or its backend's variables, on each): give --world-size N to start a group"
        )
    if (args.hostfile or args.backend) and args.world_size < 2 and not args.group:
        return "--hostfile and --backend start a worker group: give --world-size N (N >= 2)"
    if args.hostfile and not args.group:
        from mlx_worker_svc.cli.group_launch import hostfile_problem

        if problem := hostfile_problem(args.hostfile, args.world_size, args.backend or ""):
            return problem
    if args.group_port and not args.group and (problem := _group_port_problem(args)):
        return problem
    if problem := named_twice("--lora-modules", [name for name, _ in args.lora_modules]):
        return problem
    if len(args.lora_modules) > args.max_loras:
        return (
            f"--lora-modules names {len(args.lora_modules)} adapters but --max-loras is "
            f"{args.max_loras}: the first would be evicted before any request; raise "
            "--max-loras"
        )
    if args.lora_modules and (args.world_size > 1 or args.group):
        return (
            "--lora-modules: a worker group serves no LoRA adapters (its weights are "
            "sharded; adapters are not): serve them from a single worker"
        )
    for name, path in args.lora_modules:
        if not Path(path).expanduser().exists():
            return f"--lora-modules {name}={path}: no such adapter directory"
    return ""


def _group_port_problem(args: argparse.Namespace) -> str:
    """Why --group-port cannot start the group ("" when it can): the ring's N ports."""
    from mlx_worker_svc.cli.group_launch import group_backend, taken_ports

    first, count = args.group_port, args.world_size
    if count < 2:
        return "--group-port is a worker group's first port: give --world-size N (N >= 2)"
    if (backend := group_backend(args)) != "ring":
        return f"--group-port is the ring backend's first port; the {backend} backend takes none"
    if first + count - 1 > 65535:
        return (
            f"--group-port {first}: the ring takes {count} consecutive ports from it "
            f"({first} to {first + count - 1}), past 65535"
        )
    if not args.hostfile and (taken := taken_ports(first, count)):
        held = ", ".join(map(str, taken))
        return (
            f"--group-port {first}: the ring takes ports {first} to {first + count - 1} on "
            f"this machine, and {held} {'is' if len(taken) == 1 else 'are'} in use"
        )
    return ""


def _launched() -> bool:
    """Whether a launcher started this process as a rank (its variables are set)."""
    from mlx_worker_svc.cli.group_launch import launched_backend

    if launched_backend() != "ring":  # found by the backend's own variables
        return True
    return bool(os.environ.get("MLX_RANK") and os.environ.get("MLX_HOSTFILE"))


def _size(nbytes: int) -> str:
    """Bytes as the ready line shows them: GiB, or MiB below one GiB (not "0.0 GiB")."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
