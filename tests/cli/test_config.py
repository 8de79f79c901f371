"""`--config FILE`: `serve`, `fleet` and `gateway` take their flags from one TOML or YAML file.

The parsed arguments of a file are compared with those of the same flags
typed out; flags on the command line win; a misspelt key or section, or a value
its flag refuses, exits with status 2 naming it. One test starts three workers
and a gateway from a single file and talks to them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import Proc

from mlx_worker_svc.cli.main import parse_args

FLEET_TOML = """
[serve]
auto-init = true
max-num-batched-tokens = 32
grace-seconds = 1
no-prefix-caching = true
look-ahead = "after"

[serve.w1]
port = 50061

[serve.w2]
port = 50062
max_running_requests = 8

[fleet]
worker = ["127.0.0.1:50061", "127.0.0.1:50062"]
routing = "least-loaded"
probe-interval-s = 0.5

[gateway]
worker = ["127.0.0.1:50061", "127.0.0.1:50062"]
port = 8100
steps-ahead = 2
served-model-name = "tiny"
log-level = "WARNING"
"""
FLEET_YAML = """
serve:
  auto-init: true
  max-num-batched-tokens: 32
  grace-seconds: 1
  no-prefix-caching: true
  look-ahead: after
  w1: {port: 50061}
  w2: {port: 50062, max_running_requests: 8}
fleet:
  worker: ["127.0.0.1:50061", "127.0.0.1:50062"]
  routing: least-loaded
  probe-interval-s: 0.5
gateway:
  worker: ["127.0.0.1:50061", "127.0.0.1:50062"]
  port: 8100
  steps-ahead: 2
  served-model-name: tiny
  log-level: WARNING
"""
SAME_FLAGS = {
    ("serve", "w1"): "--auto-init --max-num-batched-tokens 32 --grace-seconds 1 "
    "--no-prefix-caching --look-ahead after --port 50061",
    ("serve", "w2"): "--auto-init --max-num-batched-tokens 32 --grace-seconds 1 "
    "--no-prefix-caching --look-ahead after --port 50062 --max-running-requests 8",
    ("fleet", None): "--worker 127.0.0.1:50061 --worker 127.0.0.1:50062 --routing least-loaded "
    "--probe-interval-s 0.5",
    ("gateway", None): "--worker 127.0.0.1:50061 --worker 127.0.0.1:50062 --port 8100 "
    "--steps-ahead 2 --served-model-name tiny --log-level WARNING",
}


def parsed(argv: list[str]) -> dict[str, Any]:
    """The arguments as the commands see them, less the ones that name the file."""
    skip = {"argv", "config", "config_section", "config_values", "func"}
    return {k: v for k, v in vars(parse_args(argv)).items() if k not in skip}


def with_file(path: Path, command: str, section: str | None, *flags: str) -> list[str]:
    argv = [command, "--config", str(path), *flags]
    return [*argv, "--config-section", section] if section else argv


@pytest.fixture(params=["toml", "yaml"])
def fleet_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"fleet.{request.param}"
    path.write_text(FLEET_TOML if request.param == "toml" else FLEET_YAML)
    return path


@pytest.mark.parametrize(("command", "section"), list(SAME_FLAGS))
def test_a_file_gives_what_the_same_flags_give(
    fleet_file: Path, command: str, section: str | None
) -> None:
    from_file = parsed(with_file(fleet_file, command, section))
    typed = parsed([command, *SAME_FLAGS[command, section].split()])
    assert from_file == typed
    ports = {"w1": 50061, "w2": 50062, None: 8100 if command == "gateway" else 50050}
    assert from_file["port"] == ports[section]


@pytest.mark.parametrize("spelled", ["grace_seconds", "grace-seconds"])
def test_a_sub_section_replaces_its_sections_key_however_spelled(
    tmp_path: Path, spelled: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[serve]\ngrace-seconds = 1\n\n[serve.w1]\n{spelled} = 3\n")
    args = parse_args(["serve", "--config", str(path), "--config-section", "w1"])
    assert args.grace_seconds == 3


def test_flags_on_the_command_line_win(fleet_file: Path) -> None:
    args = parsed(with_file(fleet_file, "serve", "w2", "--port", "7", "--max-running-requests=3"))
    assert (args["port"], args["max_running_requests"], args["auto_init"]) == (7, 3, True)
    # A repeatable flag replaces the file's whole list; a flag before the command counts too.
    argv = ["--log-level", "DEBUG", *with_file(fleet_file, "gateway", None, "--worker", "h:1")]
    args = parsed(argv)
    assert (args["worker"], args["log_level"], args["port"]) == (["h:1"], "DEBUG", 8100)


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The last line of what the command printed on refusing `argv` (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_misspelt_key_is_refused_with_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[gateway]\nworker = ["a:1"]\nmax-num-seq = 8\n')
    assert refusal(capsys, ["gateway", "--config", str(path)]) == (
        f"mlx-worker gateway: error: {path}: unknown key 'max-num-seq' in [gateway] "
        "(did you mean 'max-num-seqs'?)"
    )
    path.write_text("[serve]\nport = 1\n[serv]\nport = 2\n")
    assert refusal(capsys, ["serve", "--config", str(path)]).endswith(
        "unknown section 'serv' (sections: serve, fleet, gateway)"
    )
    path.write_text("[serve.w1]\nport = 1\n[serve.w1.x]\nport = 2\n")
    assert refusal(capsys, ["serve", "--config", str(path), "--config-section", "w1"]).endswith(
        "[serve.w1] x: sections do not nest further"
    )


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ("[serve]\nport = 'http'\n", [], "[serve] port = 'http': must be an integer, got 'http'"),
        ("[serve]\nauto-init = 'yes'\n", [], "[serve] auto-init = 'yes': expected true or false"),
        ("[serve]\nport = true\n", [], "[serve] port = true: expected a string or a number"),
        ("[serve]\nport = 1979-05-27\n", [], "port = 1979-05-27: expected a string or a number"),
        ("[serve]\nport = {a = 1}\n", [], "port = {a = 1}: expected a string or a number"),
        (
            "[serve]\nport = [1, 'x', {'b c' = true}]\n",
            [],
            "port = [1, 'x', {'b c' = true}]: expected a string or a number",
        ),
        ("[serve]\nkv-bits = 4.5\n", [], "[serve] kv-bits = 4.5: must be an integer, got 4.5"),
        # A flag on the command line wins, and the file's value is still checked.
        ("[serve]\nport = 70000\n", ["--port", "5"], "port = 70000: must be a port"),
        ("[serve]\ndevice = 'tpu'\n", [], "[serve] device = 'tpu': not one of auto, cpu, gpu"),
        (
            "[fleet]\nworker = 'a:1'\nsteps-ahead = 9\n",
            [],
            "steps-ahead = 9: must be in [0, 7], got 9",
        ),
        ("[serve]\nhelp = true\n", [], "unknown key 'help' in [serve]"),
        ("[gateway]\nport = 1\n", [], "no [serve] section"),
        (
            "[serve.a]\nport = 1\n",
            [],
            "[serve] has sub-sections (a): pick one with --config-section",
        ),
        ("[serve]\nport = 1\n", ["--config-section", "b"], "no [serve.b] section"),
        (
            "[serve]\nmax-running-request = {a = 1}\n",
            [],
            "('max-running-request' is no key: did you mean 'max-running-requests'?)",
        ),
        ("[serve\n", [], "not TOML"),
    ],
)
def test_a_value_its_flag_refuses_is_an_error_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, argv: list[str], message: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    command = "fleet" if "[fleet]" in text else "serve"
    assert message in refusal(capsys, [command, "--config", str(path), *argv])


@pytest.mark.parametrize(
    ("text", "argv", "message"),
    [
        ("serve:\n  port: http\n", [], "serve.port: 'http': must be an integer, got 'http'"),
        ("serve:\n  port: {a: 1}\n", [], "serve.port: {a: 1}: expected a string or a number"),
        ("serve:\n  port: [1, {b c: true}]\n", [], "port: [1, {'b c': true}]: expected"),
        ("serve:\n  auto-init: null\n", [], "serve.auto-init: null: expected true or false"),
        ("serve:\n  prot: 8\n", [], "unknown key 'prot' in serve (did you mean 'port'?)"),
        ("gateway:\n  port: 1\n", [], "no serve section"),
        ("serve:\n  a: {port: 1}\n", [], "serve has sub-sections (a): pick one"),
        ("serve:\n  port: 1\n", ["--config-section", "b"], "no serve.b section"),
        ("serve:\n  w1:\n    x: {port: 2}\n", ["--config-section", "w1"], "serve.w1.x: sections"),
        ("serve:\n  1: 2\n", [], "serve: the key 1 is not a flag's name"),
        ("true:\n  port: 1\n", [], "unknown section 'true'"),
        ("serve: null\n", [], "section 'serve' holds no keys (it is null)"),
        ("- serve\n", [], "expected sections serve, fleet and/or gateway"),
        ("serve:\n  mac1: [1]\n", ["--config-section", "mac1"], "serve.mac1 is a key, not a"),
        ("serve:\n  true: 2\n", [], "serve: the key true is not a flag's name"),
        ("serve:\n  w1:\n    null: 2\n", ["--config-section", "w1"], "serve.w1: the key null"),
    ],
)
def test_a_yaml_files_errors_are_in_its_own_notation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, argv: list[str], message: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    line = refusal(capsys, ["serve", "--config", str(path), *argv])
    assert message in line and "[serve" not in line and " = " not in line, line


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[serve]\nkv-bits = 7\n", "--kv-bits 7 is not a width MLX quantizes to"),
        ("[serve]\nkv-group-size = 32\n", "--kv-group-size 32 needs --kv-bits"),
        ("[serve]\nlora-modules = ['a=/no/such/dir']\n", "no such adapter directory"),
        ("[serve]\nworld-size = 2\nhostfile = '/no/hosts.json'\n", "cannot read it"),
        ("[fleet]\nworker = ['a:1']\nkv-bits = 7\n", "--kv-bits 7 is not a width"),
        ("[fleet]\nworker = []\n", "--worker: a fleet needs at least one worker"),
        ("[serve]\nprofile-dir = '/proc/nope'\n", "--profile-dir /proc/nope: cannot create"),
        ("[serve]\nhost = '0.0.0.0'\n", "refusing to listen on 0.0.0.0 (--host) without TLS"),
    ],
)
def test_a_flag_problem_found_after_parsing_names_the_files_key(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    command = "fleet" if "[fleet]" in text else "serve"
    argv = [sys.executable, "-m", "mlx_worker_svc", command, "--config", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"mlx-worker {command}: ") and says in line, line
    key = text.splitlines()[-1].split(" = ")[0]
    assert f"(set in {path}: [{command}] {key} = " in line, line


def test_a_missing_or_unknown_kind_of_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.toml"
    assert refusal(capsys, ["serve", "--config", str(missing)]).endswith(
        f"{missing}: cannot read it (No such file or directory)"
    )
    ini = tmp_path / "config.ini"
    ini.write_text("[serve]\n")
    assert refusal(capsys, ["serve", "--config", str(ini)]).endswith(
        "a config file is .toml, .yaml, .yml, not .ini"
    )
    assert refusal(capsys, ["serve", "--config"]).endswith(
        "mlx-worker serve: error: argument --config: expected one argument"
    )
    bad = tmp_path / "config.yaml"
    bad.write_text("serve: [1, 2\n")
    assert "not YAML" in refusal(capsys, ["serve", "--config", str(bad)])
    # A key given twice (YAML lets a later one win silently; TOML refuses it too), one
    # given in both spellings, and a section with no keys under it.
    bad.write_text("serve:\n  port: 1\n  port: 2\n")
    assert "key 'port' is given twice" in refusal(capsys, ["serve", "--config", str(bad)])
    both = tmp_path / "config.toml"
    both.write_text("[serve]\ngrace-seconds = 1\ngrace_seconds = 2\n")
    assert refusal(capsys, ["serve", "--config", str(both)]).endswith(
        "'grace-seconds' and 'grace_seconds' are the same key; give it once"
    )
    bad.write_text("serve:\n")
    assert refusal(capsys, ["serve", "--config", str(bad)]).endswith(
        "section 'serve' holds no keys (it is null)"
    )


# --------------------------------------------- three workers and a gateway
def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


@pytest.fixture
def started() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for proc in procs:
        proc.reap()


def test_one_file_starts_three_workers_and_a_gateway(
    tiny_dir: Path, tmp_path: Path, started: list[Proc]
) -> None:
    ports = free_ports(3)
    workers = [f"127.0.0.1:{port}" for port in ports]
    lines = [
        "[serve]",
        f"model = {json.dumps(str(tiny_dir))}",
        "auto-init = true",
        "grace-seconds = 1",
        *(f"[serve.w{i}]\nport = {port}" for i, port in enumerate(ports)),
        "[gateway]",
        f"worker = {json.dumps(workers)}",
        "port = 0",
        'served-model-name = "tiny"',
    ]
    config = tmp_path / "fleet.toml"
    config.write_text("\n".join(lines) + "\n")
    for i in range(3):
        started.append(Proc(["serve", "--config", str(config), "--config-section", f"w{i}"]))
    for proc, port in zip(started, ports, strict=True):
        assert int(proc.wait_for(r"listening on [\d.]+:(\d+)").group(1)) == port
        proc.wait_for(r"^ready:")
    started.append(Proc(["gateway", "--config", str(config)]))
    gateway_port = int(started[-1].wait_for(r"gateway listening on [\d.]+:(\d+)").group(1))
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", timeout=60) as http:
        deadline = time.monotonic() + 60
        while (health := http.get("/health")).json()["workers_up"] < 3:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert health.json() | {"queued": 0} == {
            "status": "ok",
            "workers_up": 3,
            "workers": 3,
            "queued": 0,
        }
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        answer = http.post("/v1/messages", json=body)
        assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] >= 1
