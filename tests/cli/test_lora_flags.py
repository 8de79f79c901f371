"""`serve --lora-modules/--max-loras`: what cannot work exits 2 at once with one line, and a bad
adapter fails the auto-init bring-up naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_worker_svc.cli.main import parse_args

SERVE = [sys.executable, "-m", "mlx_worker_svc", "serve", "--port", "0"]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--lora-modules", "a=/x", "--world-size", "2"], "a worker group serves no LoRA"),
        (
            ["--lora-modules", "a=/x", "b=/y", "c=/z", "--max-loras", "2"],
            "--lora-modules names 3 adapters but --max-loras is 2",
        ),
    ],
)
def test_impossible_lora_flags_exit_2(tiny_dir: Path, flags: list[str], says: str) -> None:
    command = [*SERVE, "--model", str(tiny_dir), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mlx-worker serve: ") and says in lines[0]


def test_a_missing_adapter_is_a_usage_error(tiny_dir: Path, tmp_path: Path) -> None:
    """Found as the command line is read, with or without --auto-init: not at the first
    LoadModel, whose caller could do nothing about it."""
    missing = tmp_path / "nowhere"
    for auto in ([], ["--auto-init"]):
        command = [*SERVE, "--model", str(tiny_dir), *auto, "--lora-modules", f"a={missing}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip() == (
            f"mlx-worker serve: --lora-modules a={missing}: no such adapter directory"
        )


def test_lora_modules_are_name_path_pairs() -> None:
    args = parse_args(["serve", "--lora-modules", "a=/x/a", "b=/x/b", "--max-loras", "3"])
    assert args.lora_modules == [("a", "/x/a"), ("b", "/x/b")] and args.max_loras == 3
    with pytest.raises(SystemExit):
        parse_args(["serve", "--lora-modules", "nopath"])


def test_a_fleet_of_several_models_needs_each_adapters_base_model(tmp_path: Path) -> None:
    fleet = [sys.executable, "-m", "mlx_worker_svc", "fleet", "--worker", "127.0.0.1:1"]
    fleet += ["--port", "0", "--models", "a=/m/a", "b=/m/b", "--lora-modules"]
    for spec, says in (
        ("ad=/x", "the fleet serves 2 models (--models), so give the adapter's base model"),
        ('{"name": "ad", "path": "/x", "base_model_name": "c"}', "'c' is none of --models"),
    ):
        done = subprocess.run(
            [*fleet, spec], capture_output=True, text=True, timeout=120, check=False
        )
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith("mlx-worker fleet: --lora-modules ad: ") and says in lines[0]
    spec = '{"name": "ad", "path": "/x", "base_model_name": "b"}'
    args = parse_args(["fleet", "--worker", "h:1", "--lora-modules", spec, "p=/y"])
    assert args.lora_modules == [("ad", "/x", "b"), ("p", "/y", "")]
    for bad in ('{"name": "ad"}', '{"name": "ad", "path": "/x", "base": "b"}', "{nope"):
        with pytest.raises(SystemExit):
            parse_args(["fleet", "--worker", "h:1", "--lora-modules", bad])


@pytest.mark.parametrize(
    ("command", "specs", "says"),
    [
        ("serve", ["x=/a", "x=/b"], "mlx-worker serve: --lora-modules names x more than once"),
        ("fleet", ["x=/a", "x=/b"], "mlx-worker fleet: --lora-modules names x more than once"),
        ("gateway", ["x=/a", "x=/b"], "mlx-worker gateway: --lora-modules names x more than once"),
        (
            "fleet",
            ['{"name": "b", "path": "/x", "base_model_name": "a"}'],
            "mlx-worker fleet: --lora-modules b: a model of the fleet has that name too",
        ),
        (
            "gateway",
            ['{"name": "b", "path": "/x", "base_model_name": "a"}'],
            "mlx-worker gateway: --lora-modules b: a model of the fleet has that name too",
        ),
        (
            "gateway",
            ["m=/a", "--model", "/models/m"],
            "mlx-worker gateway: --lora-modules m: a model of the fleet has that name too",
        ),
    ],
)
def test_an_adapter_name_given_twice_or_taken_by_a_model_exits_2(
    tiny_dir: Path, tmp_path: Path, command: str, specs: list[str], says: str
) -> None:
    """Served twice (the last path silently won) or shadowing a model's id (the gateway's
    model ids are both): refused as the command line is read."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    specs = [
        s.replace("=/a", f"={tmp_path / 'a'}").replace("=/b", f"={tmp_path / 'b'}") for s in specs
    ]
    argv = [sys.executable, "-m", "mlx_worker_svc", command, "--port", "0"]
    if command == "serve":
        argv += ["--model", str(tiny_dir)]
    else:
        argv += ["--worker", "127.0.0.1:1"]
        if "base_model_name" in specs[0]:
            argv += ["--models", "a=/m/a", "b=/m/b"]
    done = subprocess.run(
        [*argv, "--lora-modules", *specs], capture_output=True, text=True, timeout=120, check=False
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(says), lines[0]
