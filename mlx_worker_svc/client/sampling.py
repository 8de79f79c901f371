"""Sampling parameters off the wire: converted and range-checked as a worker checks them.

The worker's servicer converts every request's `SamplingParams` here; the
fleet runs the same check before it admits a request (fleet/checks.py), so a
value no worker takes is refused at once, naming the field, never sent on.
"""

from __future__ import annotations

from mlx_worker_svc.core.domain import SamplingParams
from mlx_worker_svc.core.errors import InvalidArgument, Unimplemented
from mlx_worker_svc.core.structured_outputs import StructuredOutputs
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def sampling_params(message: pb.SamplingParams, where: str) -> SamplingParams:
    """Converts and range-checks sampling parameters (errors name `where.<field>`)."""
    if message.stop:
        raise Unimplemented(
            f"{where}.stop: stop strings are checked by a scheduler that holds the text "
            "(FleetService.Generate); the worker does not honour them"
        )
    params = SamplingParams(
        temperature=message.temperature if message.HasField("temperature") else 1.0,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        top_k=0 if message.top_k == -1 else message.top_k,
        min_p=message.min_p,
        repetition_penalty=(
            message.repetition_penalty if message.HasField("repetition_penalty") else 1.0
        ),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=dict(message.logit_bias),
        seed=message.seed if message.HasField("seed") else None,
        min_tokens=message.min_tokens,
        max_tokens=message.max_tokens if message.HasField("max_tokens") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=(message.prompt_logprobs if message.HasField("prompt_logprobs") else None),
        structured_outputs=(
            structured_outputs(message.structured_outputs, f"{where}.structured_outputs")
            if message.HasField("structured_outputs")
            else None
        ),
    )
    params.validate(where)
    return params


def structured_outputs(message: pb.StructuredOutputs, where: str) -> StructuredOutputs:
    """The spec of a StructuredOutputs message (checked by SamplingParams.validate)."""
    kind = message.WhichOneof("kind") or ""
    if kind == "json_object" and not message.json_object:
        raise InvalidArgument(f"{where}.json_object must be true when set")
    return StructuredOutputs(
        kind=kind,
        text=getattr(message, kind) if kind not in ("", "choice", "json_object") else "",
        choices=tuple(message.choice.choices),
        disable_any_whitespace=message.disable_any_whitespace,
    )
