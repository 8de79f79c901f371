"""Flag values out of range are a one-line usage error (exit 2) before anything starts.

Ports past 65535 used to wrap around in the socket layer (70000 listened on
4464), a fleet's `--max-num-seqs 0` stalled every request, a bad
`--log-level` was a traceback, and `convert-gguf --out` deleted what was
there. Parsing runs in process (argparse's own exit); the checks that come
after parsing run the command.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_worker_svc.cli.main import main, parse_args
from mlx_worker_svc.core.flag_values import bind_address

WORKER = ["--worker", "127.0.0.1:9"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--port", "70000"], "--port: must be a port, 0 to 65535, got 70000"),
        (["serve", "--port", "-1"], "--port: must be a port, 0 to 65535, got -1"),
        (["serve", "--host", ""], "--host: must not be empty (127.0.0.1: this machine only"),
        (["serve", "--metrics-host", " "], "--metrics-host: must not be empty"),
        (["fleet", *WORKER, "--host", ""], "--host: must not be empty"),
        (["gateway", *WORKER, "--host", ""], "--host: must not be empty"),
        (["serve", "--metrics-port", "65536"], "--metrics-port: must be a port"),
        (["serve", "--group-port", "-1"], "--group-port: must be a port"),
        (["serve", "--memory-utilization", "0"], "--memory-utilization: must be in (0, 1]"),
        (["serve", "--memory-utilization", "nan"], "--memory-utilization: must be in (0, 1]"),
        (["serve", "--block-size", "0"], "--block-size: must be >= 1, got 0"),
        (["serve", "--num-blocks", "-1"], "--num-blocks: must be in [0, 4294967296], got -1"),
        (["serve", "--num-blocks", "5000000000"], "--num-blocks: must be in [0, 4294967296]"),
        (["serve", "--max-model-len", "-5"], "--max-model-len: must be 0 (the model's context)"),
        (
            ["serve", "--max-model-len", "1"],
            "or >= 2 (a prompt is shorter than the context), got 1",
        ),
        (["serve", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens: must be >="),
        (["serve", "--memory-limit-bytes", "-1"], "--memory-limit-bytes: must be in [0, "),
        (["serve", "--memory-limit-bytes", str(1 << 64)], "--memory-limit-bytes: must be in"),
        (["serve", "--grace-seconds", "-1"], "--grace-seconds: must be a number of seconds >="),
        (["serve", "--death-exit-seconds", "0"], "--death-exit-seconds: must be a number of"),
        (["serve", "--collective-timeout", "inf"], "--collective-timeout: must be a number of"),
        (["serve", "--world-size", "-1"], "--world-size: must be >= 0, got -1"),
        (["serve", "--max-running-requests", "0"], "--max-running-requests: must be in [1, "),
        (["serve", "--max-queued-steps", "0"], "--max-queued-steps: must be in [1, 1048576]"),
        (["serve", "--max-steps-in-flight", "-1"], "--max-steps-in-flight: must be in [1, "),
        (["serve", "--max-loras", "0"], "--max-loras: must be >= 1, got 0"),
        (["fleet", *WORKER, "--probe-misses", "0"], "--probe-misses: must be in [1, 100], got 0"),
        # gRPC deadlines past ~10^10 s overflow into expired ones: every probe would fail.
        (["fleet", *WORKER, "--probe-timeout-s", "inf"], "--probe-timeout-s: must be a number"),
        (["fleet", *WORKER, "--probe-timeout-s", "1e10"], "and at most 1000000, got 1e10"),
        (["gateway", *WORKER, "--lifecycle-timeout-s", "0"], "--lifecycle-timeout-s: must be"),
        (["fleet", *WORKER, "--probe-interval-s", "nan"], "--probe-interval-s: must be a"),
        (["serve", "--grace-seconds", "1e7"], "--grace-seconds: must be a number of seconds"),
        (["fleet", *WORKER, "--steps-ahead", "9"], "--steps-ahead: must be in [0, 7], got 9"),
        (["serve", "--port", "abc"], "--port: must be an integer, got 'abc'"),
        (["serve", "--log-level", "bogus"], "--log-level: must be one of DEBUG, INFO"),
        (["fleet", *WORKER, "--port", "70000"], "--port: must be a port"),
        (["gateway", *WORKER, "--port", "70000"], "--port: must be a port"),
        (["fleet", "--worker", "127.0.0.1:99999"], "--worker: must be a port, 0 to 65535"),
        (["fleet", "--worker", "::1:50051"], "an IPv6 address goes in brackets, as in [::1]:50051"),
        (["fleet", "--worker", "localhost"], "--worker: expected HOST:PORT, got 'localhost'"),
        (["fleet", *WORKER, "--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
        (["fleet", *WORKER, "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must"),
        (["fleet", *WORKER, "--queue", "-1"], "--queue: must be >= 1, got -1"),
        (["generate", *WORKER, "--max-tokens", "-1", "hi"], "--max-tokens: must be >= 1"),
        (["generate", *WORKER, "--temperature", "-1", "hi"], "--temperature: must be a finite"),
        (["serve", "--config-section", "b"], "--config-section names a section of a --config"),
    ],
)
def test_a_value_out_of_range_is_a_usage_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and says in lines[0], lines  # one line, as the docs say


def test_values_in_range_parse_as_before() -> None:
    args = parse_args(["serve", "--port", "0", "--memory-utilization", "1", "--log-level", "debug"])
    assert (args.port, args.memory_utilization, args.log_level) == (0, 1.0, "DEBUG")
    assert parse_args(["serve", "--log-level", "warn"]).log_level == "WARN"  # logging's alias
    args = parse_args(["fleet", "--worker", "[::1]:50051", "--port", "65535"])
    assert (args.worker, args.port) == (["[::1]:50051"], 65535)
    # --host takes an IPv6 literal as is; the server binds it in brackets.
    assert parse_args(["serve", "--host", "::1"]).host == "::1"
    assert bind_address("::1", 50051) == "[::1]:50051"
    assert bind_address("[::1]", 1) == "[::1]:1" and bind_address("0.0.0.0", 1) == "0.0.0.0:1"


def test_a_config_file_value_is_checked_as_the_flag_and_named_by_its_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[serve]\nport = 70000\n[serve.b]\nauto-init = "yes"\n')
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(config), "--config-section", "b"])
    [err] = capsys.readouterr().err.splitlines()  # one line
    assert "[serve] port = 70000: must be a port" in err  # the key's own section
    config.write_text('[serve]\nport = 1\n[serve.b]\nauto-init = "yes"\n')
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(config), "--config-section", "b"])
    assert "[serve.b] auto-init = 'yes': expected true or false" in capsys.readouterr().err


def test_convert_gguf_never_deletes_what_is_at_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"hello, not a GGUF file")
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    assert main(["convert-gguf", str(not_gguf), "--out", str(precious)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert precious.read_text() == "keep me"
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("keep me")
    assert main(["convert-gguf", str(not_gguf), "--out", str(full)]) == 2
    assert "is a directory that is not empty: give --overwrite" in capsys.readouterr().err
    # With --overwrite, a file that does not convert still leaves the directory as it was.
    assert main(["convert-gguf", str(not_gguf), "--out", str(full), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"convert-gguf: {not_gguf} is not a GGUF file (bad magic b'hell')"
    assert (full / "keep.txt").read_text() == "keep me"
    absent = tmp_path / "absent.gguf"
    assert main(["convert-gguf", str(absent), "--out", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"GGUF file not found: {absent}")
    assert main(["convert-gguf", str(full), "--out", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{full} is a directory: give a GGUF file")
    # --out and --overwrite are the file's: without one they are refused, not ignored.
    for flags in (["--out", str(tmp_path / "here")], ["--overwrite"]):
        assert main(["convert-gguf", *flags]) == 2
        assert f"convert-gguf: {flags[0]} need a GGUF file" in capsys.readouterr().err
        assert not (tmp_path / "here").exists()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mlx_worker_svc", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_port_in_use_is_one_line_naming_the_flags(tiny_dir: Path) -> None:
    """serve and fleet on a port another process holds: exit 2, one line with the cause
    (gRPC's own failure was a C-core log line and a message without the cause)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        for command in (
            ["serve", "--model", str(tiny_dir)],
            ["fleet", "--worker", "127.0.0.1:1"],
        ):
            done = _run(*command, "--port", str(port))
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line]
            assert done.returncode == 2 and len(lines) == 1, (done.stdout, done.stderr)
            said = f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"
            assert lines[0].endswith(said), lines


def test_checks_after_parsing_exit_2_with_one_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text("[]")
    done = _run("serve", "--port", "0", "--hostfile", str(hostfile))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "mlx-worker serve: --hostfile and --backend start a worker group: give "
        "--world-size N (N >= 2)"
    )
    # --group-port without a group, or beside a backend that takes no port, is no
    # silent no-op.
    done = _run("serve", "--port", "0", "--group-port", "40000")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "mlx-worker serve: --group-port is a worker group's first port: give --world-size N "
        "(N >= 2)"
    )
    done = _run("serve", "--world-size", "2", "--backend", "mpi", "--group-port", "40000")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "mlx-worker serve: --group-port is the ring backend's first port; the mpi backend "
        "takes none"
    )
    # The ring's N consecutive ports: within range, and free here (one is held below).
    done = _run("serve", "--world-size", "2", "--group-port", "65535")
    assert done.returncode == 2 and done.stderr.strip() == (
        "mlx-worker serve: --group-port 65535: the ring takes 2 consecutive ports from it "
        "(65535 to 65536), past 65535"
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        done = _run("serve", "--world-size", "2", "--group-port", str(port - 1))
    assert done.returncode == 2 and done.stdout == ""
    assert re.fullmatch(
        rf"mlx-worker serve: --group-port {port - 1}: the ring takes ports {port - 1} to "
        rf"{port} on this machine, and (\d+, )?{port} (is|are) in use",
        done.stderr.strip(),
    ), done.stderr
    done = _run("serve", "--world-size", "2", "--backend", "jaccl")
    assert done.returncode == 2 and done.stderr.strip() == (
        "mlx-worker serve: --backend jaccl needs --hostfile: the Macs' RDMA devices "
        "(mlx.distributed_config --backend jaccl writes one); or use --backend ring"
    )
    done = _run("serve", "--port", "0", "--group")  # by hand, outside mlx.launch
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "mlx-worker serve: --group is for the ranks mlx.launch starts (it sets MLX_RANK and "
        "MLX_HOSTFILE, or its backend's variables, on each): give --world-size N to start "
        "a group"
    )
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate")
    done = _run("fleet", *WORKER, "--port", "0", "--worker-ca", str(garbage))
    assert done.returncode == 2
    assert done.stderr.strip() == f"mlx-worker fleet: --worker-ca: {garbage} is not a PEM file"


def test_every_flag_with_a_default_says_it_in_its_help() -> None:
    """`mlx-worker COMMAND --help` lists every flag with its default (README)."""
    import argparse

    from mlx_worker_svc.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = []
    for name, command in commands.choices.items():
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._StoreTrueAction):
                continue
            if action.default in (None, False, [], argparse.SUPPRESS):
                continue
            if "default" not in (action.help or ""):
                silent.append(f"{name} {action.option_strings[0]}")
    assert silent == []


def test_the_ready_line_shows_a_small_memory_limit_in_mib() -> None:
    from mlx_worker_svc.cli.serve import _size

    assert (_size(33_500_000), _size(22_748_575_334)) == ("31.9 MiB", "21.2 GiB")
