"""The `serve` flags that set the engine's options, and the `EngineOptions` they build.

One argument group (`add_engine_arguments`) and one constructor
(`engine_options`): the only place the command line turns text into engine
options. Every rank of a worker group gets the same command line, so every
rank's runners get the same options. The defaults are the engine as it ships;
the flags exist for A/B runs (the GPU benchmark's worker variants). The KV
format flags (`add_kv_arguments`, `kv_format`) are lifecycle arguments
instead (DetermineMemory and InitCache's kv_bits), which `serve --auto-init`
and `fleet` pass to the workers they bring up.
"""

from __future__ import annotations

import argparse
import json

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.core.flag_values import count
from mlx_worker_svc.engine import options
from mlx_worker_svc.engine.options import LOOK_AHEAD_MODES, EngineOptions

_FUSE = {"auto": None, "on": True, "off": False}


def _rows(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """One `NAME=PATH` of `--lora-modules` (vLLM's form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH (an adapter directory)")
    return name, path


def fleet_lora_module(text: str) -> tuple[str, str, str]:
    """One adapter of the fleet's `--lora-modules`: NAME=PATH, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`; (name, path, base or "")."""
    if not text.lstrip().startswith("{"):
        return (*lora_module(text), "")
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc})") from exc
    keys = {"name", "path", "base_model_name"}
    if not isinstance(spec, dict) or set(spec) - keys or not {"name", "path"} <= set(spec):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an object with name, path and optionally base_model_name"
        )
    values = (spec["name"], spec["path"], spec.get("base_model_name", ""))
    if not all(isinstance(v, str) for v in values) or not all(values[:2]):
        raise argparse.ArgumentTypeError(f"{text!r}: name and path are non-empty strings")
    return values


def named_twice(flag: str, names: list[str]) -> str:
    """Why a list of names given to `flag` cannot work ("" when none is given twice)."""
    twice = sorted({name for name in names if names.count(name) > 1})
    return f"{flag} names {', '.join(twice)} more than once" if twice else ""


def add_lora_arguments(parser: argparse.ArgumentParser, who: str, *, fleet: bool = False) -> None:
    """`--lora-modules NAME=PATH ...` (vLLM's flag); `who` says where they load. The
    fleet's also take vLLM's JSON form, which names the adapter's base model."""
    base = (
        '; or \'{"name": NAME, "path": PATH, "base_model_name": MODEL}\' (vLLM\'s form), '
        "needed when the fleet serves several models"
        if fleet
        else ""
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=fleet_lora_module if fleet else lora_module,
        default=[],
        metavar="NAME=PATH",
        help=f"LoRA adapters (mlx_lm.lora's directories) {who}, served under NAME "
        f"(requests' lora_name; the gateway's model id){base}; docs/adapters.md",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_lora_arguments(parser, "loaded with the model")
    parser.add_argument(
        "--max-loras",
        type=count(1),
        default=8,
        metavar="N",
        help="LoRA adapters resident at once; AddLora past N evicts the least recently used "
        "one that is neither pinned nor in use (default 8)",
    )
    group = parser.add_argument_group("engine options (see README: Command line)")
    group.add_argument(
        "--look-ahead",
        choices=LOOK_AHEAD_MODES,
        default="speculate",
        help="when the next decode forward is queued: on the sampled tokens before the host "
        "reads them (speculate, the default), once the step is done (after), or never (off)",
    )
    group.add_argument(
        "--no-aligned-decode",
        action="store_true",
        help="decode batches with mlx-lm's attention mask on every step, even when all rows "
        "are equally long (default: no mask then)",
    )
    group.add_argument(
        "--fuse",
        choices=tuple(_FUSE),
        default="auto",
        help="decode steps multiply by each layer's concatenated q/k/v and gate/up weights "
        "(default auto: on with MLX's CUDA backend only)",
    )
    group.add_argument(
        "--dequant-min-batch",
        type=_rows,
        default=None,
        metavar="ROWS",
        help="decode batches of a quantized model with at least ROWS rows use dequantized "
        "weights; 0: never (default: 32 with MLX's CUDA backend, else 0)",
    )
    group.add_argument(
        "--kv-dequant-min-batch",
        type=_rows,
        default=None,
        metavar="ROWS",
        help="decode batches with quantized KV (--kv-bits) and at least ROWS rows attend it "
        "dequantized, with MLX's fused float attention; 0: never (default: 2 on the CPU for "
        "float16/bfloat16 KV, else 0; docs/kv-cache.md)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The options `add_engine_arguments`' flags ask for."""
    return EngineOptions(
        look_ahead=args.look_ahead,
        aligned_decode=not args.no_aligned_decode,
        fuse=_FUSE[args.fuse],
        dequant_min_batch=args.dequant_min_batch,
        max_loras=args.max_loras,
        lora_modules=tuple(args.lora_modules),
        kv_dequant_min_batch=args.kv_dequant_min_batch,
    )


def add_kv_arguments(parser: argparse.ArgumentParser, who: str) -> None:
    """`--kv-bits` and `--kv-group-size` (mlx-lm's names); `who` says which workers they set."""
    bits = "|".join(map(str, (0, *options.KV_BITS)))
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=0,
        metavar=bits,
        help=f"store {who}'s KV quantized to this many bits, as mlx-lm's --kv-bits does, "
        "from the first token, prefix cache included (default 0: the model's float dtype; "
        "docs/kv-cache.md)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="|".join(map(str, options.KV_GROUP_SIZES)),
        help="values per quantization group along head_dim, with --kv-bits; it must divide "
        f"the model's head_dim (default {options.DEFAULT_KV_GROUP_SIZE}, mlx-lm's)",
    )


def kv_format(args: argparse.Namespace) -> KVFormat:
    """The KV format the flags ask for; raises InvalidArgument naming the flag."""
    # Unset, the group is the default (0); given without --kv-bits, it is refused.
    group = args.kv_group_size or 0
    return options.kv_format(args.kv_bits, group, ("--kv-bits", "--kv-group-size"))
