"""The `mlx-worker` command line: `serve`, `convert-gguf`, `fleet`, `gateway` and `generate`.

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
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.flag_values import (
    context_cap,
    count,
    fraction,
    host,
    port,
    seconds,
    within,
)
from mlx_worker_svc.core.log_format import add_logging_arguments, configure_logging
from mlx_worker_svc.core.signals import STOP_SIGNALS


def _convert(args: argparse.Namespace) -> int:
    if args.gguf is None:
        given = [flag for flag, on in (("--out", args.out), ("--overwrite", args.overwrite)) if on]
        if given:  # the embedded model goes to the cache, never to --out
            print(
                f"convert-gguf: {' and '.join(given)} need a GGUF file; without one the "
                "embedded model is built in $MLX_WORKER_CACHE/models (default "
                "~/.cache/mlx-worker-svc/models)",
                file=sys.stderr,
            )
            return 2
        from mlx_worker_svc.cli.envs import cache_root
        from mlx_worker_svc.engine.model.embedded import ensure_default_model

        print(ensure_default_model(cache_root(), show_progress=True))
        return 0
    if args.out is None:
        print("convert-gguf: --out is required with a GGUF file", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.is_file() or out.is_symlink():
        print(f"convert-gguf: --out {out} is a file; give a directory", file=sys.stderr)
        return 2
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        print(
            f"convert-gguf: --out {out} is a directory that is not empty: give --overwrite to "
            "replace it (everything in it is deleted), or another path",
            file=sys.stderr,
        )
        return 2
    from mlx_worker_svc.core.errors import WorkerError
    from mlx_worker_svc.engine.model.gguf import convert_gguf

    def progress(stage: str, fraction: float) -> None:
        print(f"\r{stage}: {fraction * 100:5.1f}%", end="", file=sys.stderr, flush=True)

    try:
        done = convert_gguf(Path(args.gguf), out, progress=progress)
    except WorkerError as exc:
        print(f"\nconvert-gguf: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file was read: writing the directory failed
        print(f"\nconvert-gguf: cannot write --out {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(file=sys.stderr)
    print(done)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (`mlx-worker serve: error: argument --port: ...`), as
    every other refusal of the command line; --help has the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from mlx_worker_svc.core.limits import (
        DEFAULT_MAX_QUEUED_STEPS,
        DEFAULT_MAX_RUNNING_REQUESTS,
        DEFAULT_MAX_STEPS_IN_FLIGHT,
        MAX_LIMIT,
        MAX_NUM_BLOCKS,
        UINT64_MAX,
    )

    parser = _Parser(prog="mlx-worker", description=__doc__.split("\n\n")[0])
    add_logging_arguments(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the gRPC worker")
    serve.add_argument(
        "--model", help="model directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    serve.add_argument(
        "--host",
        type=host,
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs TLS, a token or --insecure)",
    )
    serve.add_argument("--port", type=port, default=50051, help="port (default 50051; 0 = any)")
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
        help="models the worker holds at once: 1, the only value and the default "
        "(LoadModel replaces the model; a fleet with --models swaps models between "
        "workers, docs/fleet.md)",
    )
    serve.add_argument(
        "--device",
        choices=[k.value for k in DeviceKind],
        default="auto",
        help="InitDevice's device with --auto-init (default auto: the GPU when MLX has one)",
    )
    serve.add_argument(
        "--max-model-len",
        type=context_cap,
        default=0,
        help="cap the context length, at least 2 (default 0: the model's)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=count(0),
        default=0,
        help="profiling size for auto-init (default: DetermineMemory's device default, 32 on "
        "CPU and 2048 on GPU)",
    )
    serve.add_argument(
        "--memory-utilization",
        type=fraction,
        default=0.9,
        help="share of the device's memory auto-init budgets, in (0, 1] (default 0.9)",
    )
    serve.add_argument(
        "--block-size", type=count(1), default=16, help="tokens a KV block holds (default 16)"
    )
    serve.add_argument(
        "--num-blocks",
        type=within(0, MAX_NUM_BLOCKS),
        default=0,
        help="KV blocks for auto-init (default 0: the suggested number)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="auto-init without the prefix cache (default: on where the model allows it)",
    )
    serve.add_argument(
        "--memory-limit-bytes",
        type=within(0, UINT64_MAX),
        default=0,
        help="auto-init memory limit (default 0: derived from the budget, see the proto)",
    )
    serve.add_argument(
        "--grace-seconds",
        type=seconds(zero=True),
        default=30.0,
        help="drain time on SIGTERM (default 30; 0: abort in-flight work at once)",
    )
    serve.add_argument(
        "--max-running-requests",
        type=within(1, MAX_LIMIT),
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="live requests admitted; past it RESOURCE_EXHAUSTED at once "
        f"(default {DEFAULT_MAX_RUNNING_REQUESTS})",
    )
    serve.add_argument(
        "--max-queued-steps",
        type=within(1, MAX_LIMIT),
        default=DEFAULT_MAX_QUEUED_STEPS,
        help="Execute steps and Generate starts waiting for the engine; past it "
        f"RESOURCE_EXHAUSTED at once (default {DEFAULT_MAX_QUEUED_STEPS})",
    )
    serve.add_argument(
        "--max-steps-in-flight",
        type=within(1, MAX_LIMIT),
        default=DEFAULT_MAX_STEPS_IN_FLIGHT,
        help="steps of one ExecuteStream read ahead of their responses "
        f"(default {DEFAULT_MAX_STEPS_IN_FLIGHT})",
    )
    serve.add_argument(
        "--death-exit-seconds",
        type=seconds(zero=False),
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
    from mlx_worker_svc.cli.serve import serve as serve_command

    serve.set_defaults(func=serve_command)

    convert = sub.add_parser(
        "convert-gguf", help="convert a llama GGUF file (default: build the embedded model)"
    )
    convert.add_argument("gguf", nargs="?", help="GGUF file (omit to build the default model)")
    convert.add_argument(
        "--out", help="output model directory: new, or empty (else see --overwrite)"
    )
    convert.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out directory (everything in it is deleted)",
    )
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
        type=count(0),
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
        "--group-port",
        type=port,
        default=0,
        help="ring backend: first port (default 0: a free one)",
    )
    group.add_argument(
        "--collective-timeout",
        type=seconds(zero=False),
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
    # gRPC's C library logs in its own format beside ours (a line per client's failed TLS
    # handshake): errors only, unless the environment says otherwise.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    if args.command in ("serve", "fleet", "gateway"):
        _stop_signals_exit()
    configure_logging(args.log_level, args.log_format)
    return int(args.func(args))


def _stop_signals_exit() -> None:
    """Until the command installs its drain, SIGTERM or SIGINT ends it at once with
    exit 0 (nothing is served yet), not Python's 143 or a KeyboardInterrupt traceback."""

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


if __name__ == "__main__":
    raise SystemExit(main())
