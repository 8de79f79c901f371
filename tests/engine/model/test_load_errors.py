"""What a failed mlx_lm.load means to a LoadModel caller: the status and the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_worker_svc.core.errors import InvalidArgument, NotFound, Unavailable, WorkerError
from mlx_worker_svc.core.reports import LoadSpec
from mlx_worker_svc.engine.model import loader


class ConnectError(Exception):
    """Named as httpx's is (the hub client's failed connection)."""


class LocalEntryNotFoundError(FileNotFoundError):
    """Named as huggingface_hub's is: no copy, and the hub could not be reached."""


def _wrapped_connect_error() -> Exception:
    try:
        try:
            raise ConnectError("[Errno -3] Temporary failure in name resolution")
        except ConnectError as inner:
            raise LocalEntryNotFoundError("cannot find the requested files") from inner
    except LocalEntryNotFoundError as outer:
        return outer


class RepositoryNotFoundError(OSError):
    """Named as huggingface_hub's is; an OSError, as its HTTP errors are."""


@pytest.mark.parametrize(
    ("raised", "expected", "says"),
    [
        (ConnectError("[Errno -3] name resolution"), Unavailable, "no connection to the model"),
        (ConnectionResetError("reset by peer"), Unavailable, "no connection to the model"),
        (RepositoryNotFoundError("404"), NotFound, "was not found"),
        (_wrapped_connect_error(), Unavailable, "no connection to the model"),
        (LocalEntryNotFoundError("HF_HUB_OFFLINE is set"), Unavailable, "no connection"),
        (OSError("disk quota"), Unavailable, "could not be fetched"),
        (FileNotFoundError("model.safetensors"), InvalidArgument, "could not be loaded"),
        (ValueError("bad shapes"), InvalidArgument, "could not be loaded"),
    ],
)
def test_a_failed_load_is_told_by_its_cause(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, expected: type[WorkerError], says: str
) -> None:
    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr("mlx_lm.load", fail)
    with pytest.raises(WorkerError) as info:
        loader.load(LoadSpec(model="someorg/some-model"))
    assert type(info.value) is expected
    assert says in info.value.message and "'someorg/some-model'" in info.value.message


def test_a_bad_adapter_is_named_in_the_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name in loader.ADAPTER_FILES:
        (adapter / name).write_text("{}")

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise ValueError("incompatible tensors")

    monkeypatch.setattr("mlx_lm.load", fail)
    with pytest.raises(InvalidArgument) as info:
        loader.load(LoadSpec(model="someorg/some-model", adapter_path=str(adapter)))
    assert f"with LoadModel.adapter_path '{adapter}' could not be loaded" in info.value.message


def test_an_architecture_mlx_lm_lacks_is_invalid_not_missing(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """mlx-lm's "Model type X not supported." chains a ModuleNotFoundError: the directory
    is there, so it is INVALID_ARGUMENT, not NOT_FOUND ("was not found")."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "foobar_lm"}))
    with pytest.raises(WorkerError) as info:
        loader.load(LoadSpec(model=str(model)))
    assert type(info.value) is InvalidArgument
    assert "could not be loaded: Model type foobar_lm not supported" in info.value.message
