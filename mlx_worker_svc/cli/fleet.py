"""`mlx-worker fleet`, `gateway` and `generate`: the fleet scheduler from a shell.

`fleet` serves `mlx_worker.v1.FleetService` in front of the given workers;
`gateway` serves OpenAI's and Anthropic's HTTP APIs (mlx_worker_svc.gateway) over
the same scheduler, in-process; `generate` runs the scheduler for one prompt
and streams the text to the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from typing import Any

from mlx_worker_svc.cli.config_file import usage_error
from mlx_worker_svc.cli.envs import MLX_GATEWAY_API_KEY
from mlx_worker_svc.core.domain import MAX_DECODE_STEPS
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.core.flag_values import count, non_negative, seconds, target, within
from mlx_worker_svc.core.flag_values import host as host_value
from mlx_worker_svc.core.flag_values import port as port_value
from mlx_worker_svc.core.signals import STOP_SIGNALS, Signals
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def _fleet_config(args: argparse.Namespace) -> Any:
    """The FleetConfig the flags ask for.

    Raises SecurityError for bad --worker-* options, ValueError for a model named
    twice, InvalidArgument for bad --kv-* ones.
    """
    from mlx_worker_svc.cli.engine_flags import kv_format, named_twice
    from mlx_worker_svc.cli.security_flags import worker_client_from_args
    from mlx_worker_svc.client.worker import ClientConfig
    from mlx_worker_svc.fleet import FleetConfig, LinkConfig
    from mlx_worker_svc.fleet.models import model_dir_name

    if not args.worker:  # a --config file's `worker = []`: argparse saw it given
        raise ValueError("--worker: a fleet needs at least one worker (HOST:PORT)")
    adapters = [name for name, _, _ in args.lora_modules]
    models_named = [name for name, _ in args.models or []]
    for flag, names in (("--models", models_named), ("--lora-modules", adapters)):
        if problem := named_twice(flag, names):
            raise ValueError(problem)
    models = dict(args.models or [])
    # The gateway's model ids are both models' names and adapters'.
    own = model_dir_name(args.model) if args.model else None  # --model's name
    clash = sorted({*models, getattr(args, "served_model_name", None), own} & set(adapters))
    if clash:
        raise ValueError(
            f"--lora-modules {clash[0]}: a model of the fleet has that name too; name the "
            "adapter otherwise"
        )
    for name, _, base in args.lora_modules:
        if base and models and base not in models:
            raise ValueError(
                f"--lora-modules {name}: base_model_name {base!r} is none of --models "
                f"({', '.join(models)})"
            )
        if not base and len(models) > 1:
            raise ValueError(
                f"--lora-modules {name}: the fleet serves {len(models)} models (--models), so "
                f'give the adapter\'s base model: \'{{"name": "{name}", "path": ..., '
                f'"base_model_name": ...}}\''
            )
    credentials, token = worker_client_from_args(args)
    kv = kv_format(args)
    link = LinkConfig(
        model=args.model or "",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_steps=args.decode_steps,
        steps_ahead=args.steps_ahead,
        probe_interval=args.probe_interval_s,
        probe_timeout=args.probe_timeout_s,
        probe_misses=args.probe_misses,
        lifecycle_timeout=args.lifecycle_timeout_s,
        client=ClientConfig(credentials=credentials, token=token),
        kv_bits=kv.bits,
        kv_group_size=kv.group_size,
    )
    return FleetConfig(
        link=link,
        queue_capacity=args.queue,
        routing=args.routing,
        models=models,
        lora_modules={name: path for name, path, _ in args.lora_modules},
        lora_bases={name: base for name, _, base in args.lora_modules if base},
    )


async def _run_fleet(args: argparse.Namespace) -> int:
    from mlx_worker_svc.cli.security_flags import server_security_from_args
    from mlx_worker_svc.fleet import FleetScheduler
    from mlx_worker_svc.fleet.server import serve_fleet, stop_fleet
    from mlx_worker_svc.rpc.metrics import MetricsEndpoint
    from mlx_worker_svc.rpc.security import SecurityError

    try:  # before any worker is contacted
        security = server_security_from_args(args)
        config = _fleet_config(args)
    except (SecurityError, ValueError, WorkerError) as exc:
        return usage_error(args, exc)
    fleet = FleetScheduler(args.worker, config)
    await fleet.start()
    endpoint = MetricsEndpoint(fleet.metrics.registry)
    try:
        if args.metrics_port is not None:
            endpoint.start(args.metrics_host, args.metrics_port)
        server, port = await serve_fleet(fleet, args.host, args.port, security)
    except (OSError, SecurityError) as exc:
        logging.error("%s", exc)
        endpoint.close()
        await fleet.stop()
        return 2
    print(f"mlx-worker fleet listening on {args.host}:{port}", flush=True)
    if endpoint.port:
        print(f"mlx-worker fleet metrics on {args.metrics_host}:{endpoint.port}", flush=True)
    stop = asyncio.Event()
    signals = Signals()

    def on_signal() -> None:  # the first drains; a second cuts the grace short
        if signals.arrived() == "again":
            fleet.hurry()
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    await stop.wait()
    await fleet.drain(args.grace_seconds)  # health NOT_SERVING, new calls UNAVAILABLE
    await stop_fleet(server, grace=1.0)  # the last replies go out
    endpoint.close()
    await fleet.stop()
    return 0


async def _run_gateway(args: argparse.Namespace) -> int:
    from mlx_worker_svc.cli.security_flags import server_security_from_args
    from mlx_worker_svc.fleet import FleetScheduler
    from mlx_worker_svc.gateway import GatewayConfig, GatewayServer
    from mlx_worker_svc.rpc.security import SecurityError

    if args.served_model_name and args.models:
        return usage_error(
            args,
            "--served-model-name names the fleet's only model; with --models each model "
            "is served by the name given there",
        )
    try:  # before any worker is contacted
        security = server_security_from_args(args)
        fleet_config = _fleet_config(args)
        config = GatewayConfig(
            served_model_name=args.served_model_name,
            security=security,
            allowed_origins=tuple(args.allowed_origins),
        )
        server = GatewayServer(
            FleetScheduler(args.worker, fleet_config),
            args.host,
            args.port,
            config,
            grace=args.grace_seconds,
        )
        await server.start()  # the app's lifespan starts the fleet
    except (OSError, SecurityError, ValueError, WorkerError) as exc:
        return usage_error(args, exc)
    print(f"mlx-worker gateway listening on {args.host}:{server.port}", flush=True)
    signals = Signals()

    def on_signal() -> None:  # the first drains; a second cuts the grace short
        if signals.arrived() != "same":
            server.stop()

    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    await server.wait()
    return 0


async def _run_generate(args: argparse.Namespace) -> int:
    from mlx_worker_svc.client.errors import ClientError
    from mlx_worker_svc.fleet import FleetError, FleetScheduler
    from mlx_worker_svc.rpc.security import SecurityError

    try:
        config = _fleet_config(args)
    except (SecurityError, ValueError, WorkerError) as exc:
        return usage_error(args, exc)
    fleet = FleetScheduler(args.worker, config)
    await fleet.start()
    sampling = pb.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    request = pb.GenerateRequest(
        sampling_params=sampling, model=args.model_name, lora_name=args.lora_name
    )
    if args.raw:
        request.prompt = args.prompt
    else:
        request.messages.add(role="user", content=args.prompt)
    code = 0
    try:
        async for chunk in fleet.generate(request):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except (FleetError, ClientError) as exc:
        print(f"\ngenerate: {exc}", file=sys.stderr)
        code = 1
    finally:
        await fleet.stop()
    return code


def _model_entry(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _decode_steps(text: str) -> int:
    steps = int(text)
    if not 1 <= steps <= MAX_DECODE_STEPS:
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_DECODE_STEPS}], got {steps}")
    return steps


def _add_probe_arguments(cmd: argparse.ArgumentParser) -> None:
    """Health probes and lifecycle deadlines (LinkConfig); README: Fleet, Failover."""
    from mlx_worker_svc.fleet import LinkConfig

    default = LinkConfig()
    cmd.add_argument(
        "--probe-interval-s",
        type=seconds(zero=False),
        metavar="SECONDS",
        default=default.probe_interval,
        help="CheckHealth every this many seconds while a worker is idle or a step's reply "
        f"is later than that (default {default.probe_interval:g})",
    )
    cmd.add_argument(
        "--probe-timeout-s",
        type=seconds(zero=False),
        metavar="SECONDS",
        default=default.probe_timeout,
        help=f"deadline of one probe, never retried (default {default.probe_timeout:g})",
    )
    cmd.add_argument(
        "--probe-misses",
        type=within(1, 100),
        metavar="N",
        default=default.probe_misses,
        help=f"probes missed in a row that make a worker hung (default {default.probe_misses}); "
        "a hang is found within N x (interval + timeout) seconds, a refused connection at once",
    )
    cmd.add_argument(
        "--lifecycle-timeout-s",
        type=seconds(zero=False),
        metavar="SECONDS",
        default=default.lifecycle_timeout,
        help="deadline of each lifecycle call made to a worker that is not up "
        f"(default {default.lifecycle_timeout:g})",
    )


def add_commands(sub: Any) -> None:
    """Adds `fleet`, `gateway` and `generate` to the `mlx-worker` subcommands."""
    from mlx_worker_svc.cli.config_file import COMMANDS, add_config_arguments
    from mlx_worker_svc.cli.engine_flags import add_kv_arguments, add_lora_arguments
    from mlx_worker_svc.cli.security_flags import add_server_arguments, add_worker_client_arguments
    from mlx_worker_svc.rpc.metrics import add_metrics_arguments

    for name, help_text, runner in (
        ("fleet", "serve FleetService in front of workers", _run_fleet),
        (
            "gateway",
            "serve OpenAI's and Anthropic's HTTP APIs in front of workers",
            _run_gateway,
        ),
        ("generate", "stream one answer from the workers to the terminal", _run_generate),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument(
            "--worker",
            action="append",
            required=True,
            type=target,
            metavar="HOST:PORT",
            help="repeatable",
        )
        which = cmd.add_mutually_exclusive_group()
        which.add_argument("--model", help="LoadModel for workers that have none loaded yet")
        which.add_argument(
            "--models",
            nargs="+",
            type=_model_entry,
            metavar="NAME=PATH",
            help="the models to serve, by the name requests give (GenerateRequest.model, the "
            "API's model); workers with none loaded load them in turn, and a request for one "
            "that no worker holds loads it on the idle worker used least recently, in place "
            "of its model (docs/fleet.md#many-models)",
        )
        for flag, default, what in (
            ("--max-num-seqs", 64, "requests a step holds"),
            ("--max-num-batched-tokens", 512, "tokens a step computes"),
        ):
            cmd.add_argument(
                flag, type=count(1), default=default, help=f"{what} (default {default})"
            )
        cmd.add_argument(
            "--decode-steps",
            type=_decode_steps,
            default=1,
            help=f"decode steps per Execute call while every request decodes (1-"
            f"{MAX_DECODE_STEPS}, default 1): fewer round trips, tokens streamed in groups of "
            "up to this many",
        )
        cmd.add_argument(
            "--steps-ahead",
            type=within(0, 7),
            default=1,
            metavar="N",
            help="steps sent to each worker ahead of the oldest reply, through ExecuteStream "
            "(0-7, default 1); 0 drives workers through unary Execute, one step at a time",
        )
        _add_probe_arguments(cmd)
        if name in ("fleet", "gateway"):
            cmd.add_argument(
                "--grace-seconds",
                type=seconds(zero=True),
                default=30.0,
                help="on SIGTERM: requests in flight may finish for this long, new ones are "
                "refused (UNAVAILABLE, HTTP 503); then those left end ABORTED (default 30)",
            )
        add_kv_arguments(cmd, "the workers it brings up (DetermineMemory and InitCache)")
        cmd.add_argument("--queue", type=count(1), default=256, help="queue bound (default 256)")
        cmd.add_argument(
            "--routing",
            choices=["prefix", "least-loaded"],
            default="prefix",
            help="where a request goes: the worker holding its longest prefix, or the least "
            "loaded (default prefix)",
        )
        add_lora_arguments(
            cmd, "the fleet loads (AddLora) on a worker when none holds one", fleet=True
        )
        if name in ("fleet", "gateway"):
            port = 50050 if name == "fleet" else 8000
            cmd.add_argument(
                "--host",
                type=host_value,
                default="127.0.0.1",
                help="default 127.0.0.1; any other needs TLS, a token or --insecure",
            )
            cmd.add_argument(
                "--port", type=port_value, default=port, help=f"default {port}; 0 = any"
            )
        if name == "fleet":
            add_server_arguments(cmd)
            add_metrics_arguments(cmd)
        elif name == "gateway":
            add_server_arguments(
                cmd,
                token_flag="--api-key-file",
                token_env=MLX_GATEWAY_API_KEY,
                health="GET /health",
            )
            cmd.add_argument(
                "--served-model-name",
                help="the model id clients use when the fleet serves one model (default: the "
                "workers' model directory name; with --models, the names given there)",
            )
            cmd.add_argument(
                "--allowed-origins",
                nargs="+",
                default=[],
                metavar="ORIGIN",
                help="answer browsers' CORS requests from these origins ('*': any; default: "
                "none, no CORS headers)",
            )
        else:
            cmd.add_argument("prompt", help="the user's message (with --raw: the prompt text)")
            cmd.add_argument(
                "--max-tokens", type=count(1), default=128, help="tokens to generate (default 128)"
            )
            cmd.add_argument(
                "--temperature",
                type=non_negative,
                default=0.0,
                help="sampling temperature (default 0: greedy, unlike the Generate RPC's "
                "default of 1)",
            )
            cmd.add_argument(
                "--raw",
                action="store_true",
                help="send the prompt as text, without the chat template (default: a chat)",
            )
            cmd.add_argument(
                "--model-name",
                default="",
                metavar="NAME",
                help="the model that answers (GenerateRequest.model): one of the names of "
                "--models; default the fleet's only model",
            )
            cmd.add_argument(
                "--lora-name",
                default="",
                metavar="NAME",
                help="the LoRA adapter that answers (GenerateRequest.lora_name): one a worker "
                "holds or one of --lora-modules; default none (the base model)",
            )
        add_worker_client_arguments(cmd)
        if name in COMMANDS:
            add_config_arguments(cmd)

        def run(args: argparse.Namespace, runner: Any = runner) -> int:
            with contextlib.suppress(KeyboardInterrupt):
                return int(asyncio.run(runner(args)))
            return 130

        cmd.set_defaults(func=run)
