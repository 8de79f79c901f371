"""Builds LoRA adapters in `mlx_lm.lora`'s format for the tests and benchmarks.

`make_adapter` applies mlx-lm's own `linear_to_lora_layers` to the model (so
the targets and names are mlx-lm's), fills `lora_a` with random values and
`lora_b` with NON-zero random values (a fresh LoRA's B is zero, which would
change nothing), and saves `adapter_config.json` and `adapters.safetensors`
as `mlx_lm.lora` does: the directory `mlx_lm.load(model, adapter_path=...)`
takes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model


def make_adapter(
    out: Path,
    model_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    scale: float = 4.0,
    keys: Sequence[str] | None = ("self_attn.q_proj", "self_attn.v_proj"),
    num_layers: int = -1,
    b_std: float = 0.05,
) -> Path:
    """Writes an adapter for `model_dir` into `out`; returns `out`.

    `keys` that name no linear layer of the model (a fused `qkv_proj` model's
    `q_proj`) write an adapter of no tensor, which LoadModel and AddLora refuse.
    """
    model, _ = load_model(model_dir, lazy=True)  # shapes only: no weight is read
    params: dict[str, object] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = list(keys)
    linear_to_lora_layers(model, num_layers, params)
    key = mx.random.key(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("lora_a", "lora_b"):
            continue
        key, sub = mx.random.split(key)
        std = b_std if leaf == "lora_b" else 1 / value.shape[0] ** 0.5
        weights[name] = (mx.random.normal(value.shape, key=sub) * std).astype(value.dtype)
    out.mkdir(parents=True, exist_ok=True)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    return out
