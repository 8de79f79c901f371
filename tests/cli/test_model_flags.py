"""The many-model flags refuse what they cannot do, naming the flag, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_worker_svc.cli.main import main, parse_args


def test_serve_holds_one_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-loaded-models", "2"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--max-loaded-models: must be 1, got 2" in error and "--models" in error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fleet", "--models", "a"], "--models: expected NAME=PATH, got 'a'"),
        (["fleet", "--model", "m", "--models", "a=/m"], "not allowed with argument --model"),
    ],
)
def test_bad_model_lists_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--worker", "127.0.0.1:1"])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fleet", "--models", "a=/m", "a=/n"], "--models names a more than once"),
        (
            ["gateway", "--models", "a=/m", "--served-model-name", "x"],
            "--served-model-name names the fleet's only model",
        ),
    ],
)
def test_conflicting_model_flags_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*argv, "--worker", "127.0.0.1:1", "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_a_config_file_lists_the_models(tmp_path: Path) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[fleet]\nworker = ["127.0.0.1:1"]\nmodels = ["a=/m/a", "b=/m/b"]\n')
    args = parse_args(["fleet", "--config", str(config)])
    assert args.models == [("a", "/m/a"), ("b", "/m/b")]
    args = parse_args(["fleet", "--config", str(config), "--models", "c=/m/c"])
    assert args.models == [("c", "/m/c")]  # the command line wins
