"""`serve --profile-dir`: a directory that cannot hold profiles stops serve at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_worker_svc.cli.main import build_parser


def test_the_flag_is_off_by_default_and_documented(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).profile_dir is None
    assert parser.parse_args(["serve", "--profile-dir", "p"]).profile_dir == "p"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "--profile-dir DIR" in capsys.readouterr().out


def test_serve_refuses_a_profile_dir_that_is_a_file(tiny_dir: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file, not a directory")
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--model", str(tiny_dir)]
    command += ["--port", "0", "--profile-dir", str(taken / "profiles")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"mlx-worker serve: --profile-dir {taken / 'profiles'}: cannot create it")
    )
    assert "listening" not in done.stdout
