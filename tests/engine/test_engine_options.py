"""Engine options: what `serve`'s flags build, the backend defaults, and bad values."""

from __future__ import annotations

import pytest

from mlx_worker_svc.cli.engine_flags import engine_options
from mlx_worker_svc.cli.main import build_parser
from mlx_worker_svc.engine.options import EngineOptions


def options_of(*flags: str) -> EngineOptions:
    return engine_options(build_parser().parse_args(["serve", *flags]))


def test_the_defaults_are_the_engine_as_it_ships() -> None:
    assert options_of() == EngineOptions()
    assert EngineOptions().look_ahead == "speculate" and EngineOptions().aligned_decode
    # Fused products and dequantized batches: on with CUDA only, unless asked.
    assert EngineOptions().fused(cuda=True) and not EngineOptions().fused(cuda=False)
    assert EngineOptions().dequant_rows(cuda=True) == 32
    assert EngineOptions().dequant_rows(cuda=False) == 0
    assert EngineOptions(fuse=True).fused(cuda=False)
    assert EngineOptions(dequant_min_batch=0).dequant_rows(cuda=True) == 0
    # Quantized KV attended dequantized: batches from 2 rows, half-precision KV, CPU only.
    for dtype in ("float16", "bfloat16"):
        assert EngineOptions().kv_dequant_rows(gpu=False, dtype=dtype) == 2
        assert EngineOptions().kv_dequant_rows(gpu=True, dtype=dtype) == 0
    assert EngineOptions().kv_dequant_rows(gpu=False, dtype="float32") == 0
    assert EngineOptions(kv_dequant_min_batch=5).kv_dequant_rows(gpu=True, dtype="float32") == 5
    assert EngineOptions(kv_dequant_min_batch=0).kv_dequant_rows(gpu=False, dtype="float16") == 0


def test_every_flag_sets_its_option() -> None:
    got = options_of(
        *("--look-ahead", "after", "--no-aligned-decode", "--fuse", "off"),
        *("--dequant-min-batch", "8", "--kv-dequant-min-batch", "4"),
    )
    assert got == EngineOptions(
        look_ahead="after",
        aligned_decode=False,
        fuse=False,
        dequant_min_batch=8,
        kv_dequant_min_batch=4,
    )
    assert options_of("--fuse", "on").fuse is True


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--look-ahead", "sometimes"], "--look-ahead"),
        (["--fuse", "yes"], "--fuse"),
        (["--dequant-min-batch", "-1"], "--dequant-min-batch"),
        (["--dequant-min-batch", "many"], "--dequant-min-batch"),
        (["--kv-dequant-min-batch", "-3"], "--kv-dequant-min-batch"),
    ],
)
def test_a_bad_flag_exits_naming_it(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        options_of(*flags)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ValueError, match="look_ahead 'later'"):
        EngineOptions(look_ahead="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dequant_min_batch must be >= 0"):
        EngineOptions(dequant_min_batch=-2)
    with pytest.raises(ValueError, match="kv_dequant_min_batch must be >= 0"):
        EngineOptions(kv_dequant_min_batch=-1)
