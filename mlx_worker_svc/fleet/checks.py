"""What the fleet checks of a Generate request before it routes it, in the request's terms.

`check_forms` refuses what no worker could run (`BadRequest`: sampling
parameters a worker refuses included); `check_fits`
refuses what a worker of the request's model would refuse mid-step: a token id
out of its vocabulary (`OutOfVocabulary`) or a prompt past its context
(`ContextTooLong`). `check_size` and `check_message` refuse a prompt's text or
a request (its structured-output spec, say) larger than a worker takes in one
gRPC message, which would otherwise break the step that carries it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_worker_svc.client.sampling import sampling_params
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.fleet.errors import (
    BadRequest,
    ContextTooLong,
    OutOfVocabulary,
    PromptTooLarge,
)
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def check_forms(request: pb.GenerateRequest) -> pb.TokenizeRequest | None:
    """Raises BadRequest; returns the Tokenize call its prompt needs (None: token ids)."""
    forms = sum(bool(x) for x in (request.prompt, request.messages, request.prompt_token_ids))
    if forms != 1:
        raise BadRequest("Generate needs exactly one of prompt, messages or prompt_token_ids")
    if request.sampling_params.HasField("prompt_logprobs"):
        raise BadRequest(
            "sampling_params.prompt_logprobs: GenerateResponse has no field for them; "
            "use WorkerService.Execute"
        )
    if request.tools_json and not request.messages:
        raise BadRequest("tools_json needs messages (a chat to render the tools into)")
    params = request.sampling_params
    for i, stop in enumerate(params.stop):
        if not stop:
            raise BadRequest(f"sampling_params.stop[{i}] is empty; a stop string needs a character")
    # What a worker would refuse in the step that starts it (InvalidArgument); the
    # fleet checks stop strings itself (above), so they are not the worker's.
    sent = pb.SamplingParams()
    sent.CopyFrom(params)
    sent.ClearField("stop")
    try:
        sampling_params(sent, "sampling_params")
    except WorkerError as exc:
        raise BadRequest(exc.message) from exc
    if request.prompt_token_ids:
        return None
    if request.messages:
        return pb.TokenizeRequest(messages=request.messages, tools_json=request.tools_json)
    return pb.TokenizeRequest(text=request.prompt, add_special_tokens=True)


def check_size(ask: pb.TokenizeRequest, max_message: int, context_length: int) -> None:
    """Raises PromptTooLarge for prompt text past what a worker tokenizes in one message
    (0: unknown), which its Tokenize would refuse: as its transport error past the
    message size, or, for chat messages past half of it, as a reply too large to send
    (the rendered text comes back with the tokens)."""
    size = ask.ByteSize()
    limit = max_message // 2 if ask.messages else max_message
    if max_message and size > limit:
        field = "messages" if ask.messages else "prompt"
        raise PromptTooLarge(field, size, limit, context_length)


# Room in a step's message beside one new request: its id, scheduled count, the step's own fields.
STEP_BYTES = 1024


def new_request_bytes(request: pb.NewRequest) -> int:
    """What `request` adds to an ExecuteRequest: itself, and its id again with its
    scheduled count (`num_scheduled_tokens`)."""
    return request.ByteSize() + len(request.req_id.encode()) + 16


def check_message(
    req_id: str, prompt: list[int], params: pb.SamplingParams, max_message: int
) -> None:
    """Raises BadRequest for a request that alone is more than a worker takes in one
    message (0: unknown), naming its largest part."""
    new = pb.NewRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=params)
    size = new_request_bytes(new) + STEP_BYTES
    if max_message and size > max_message:
        raise too_large(new, max_message, size)


def too_large(new: pb.NewRequest, max_message: int, size: int) -> BadRequest:
    """The BadRequest of a request that takes a step's message to `size` bytes, past
    `max_message`, naming the request's largest part (its id counted twice, as a step
    carries it)."""
    params = new.sampling_params
    parts = {
        "request_id": 2 * len(new.req_id.encode()),
        "prompt_token_ids": pb.NewRequest(prompt_token_ids=new.prompt_token_ids).ByteSize(),
    }
    for field, _ in params.ListFields():
        alone = pb.SamplingParams()
        alone.CopyFrom(params)
        for other, _ in params.ListFields():
            if other is not field:
                alone.ClearField(other.name)
        parts[f"sampling_params.{field.name}"] = alone.ByteSize()
    largest = max(parts, key=lambda name: parts[name])
    return BadRequest(
        f"{largest}: the request takes {size} bytes ({parts[largest]} of them this field's), "
        f"more than a worker of the model takes in one message ({max_message} bytes, sized "
        "to its context)"
    )


def check_fits(
    prompt: list[int],
    params: pb.SamplingParams,
    reserve: bool,
    *,
    vocab_size: int,
    max_context: int,
    kv_budgets: Sequence[tuple[int, int]] = (),
    field: str = "prompt_token_ids",
) -> None:
    """Raises OutOfVocabulary or ContextTooLong (0 for a limit: unknown, not checked);
    `field` is the request's prompt (prompt_token_ids, prompt or messages);
    `kv_budgets` the (num_blocks, block_size) of the workers up with the model."""
    named = {
        "prompt_token_ids": prompt,
        "sampling_params.logit_bias": list(params.logit_bias),
        "sampling_params.stop_token_ids": list(params.stop_token_ids),
    }
    for name, ids in named.items():
        if vocab_size and max(ids, default=0) >= vocab_size:
            raise OutOfVocabulary(name, next(t for t in ids if t >= vocab_size), vocab_size)
    max_tokens = params.max_tokens if params.HasField("max_tokens") else None
    # Room for one generated token at least, as a worker requires of a prompt.
    need = len(prompt) + ((max_tokens or 1) if reserve else 1)
    if max_context and need > max_context:
        raise ContextTooLong(field, len(prompt), max_tokens if reserve else None, max_context)
    check_kv_budgets(need, kv_budgets, field, len(prompt), max_tokens if reserve else None)


def check_kv_budgets(
    need: int,
    kv_budgets: Sequence[tuple[int, int]],
    field: str,
    prompt_tokens: int,
    max_tokens: int | None = None,
) -> None:
    """Raises ContextTooLong when no worker's whole KV budget, (num_blocks, block_size)
    each (none known: not checked), holds `need` tokens: a worker's budget may hold fewer
    than the context, and one that cannot hold a request alone never runs it (it would
    wait there for good)."""
    refusal = kv_budget_refusal(need, kv_budgets, field, prompt_tokens, max_tokens)
    if refusal is not None:
        raise refusal


def kv_budget_refusal(
    need: int,
    kv_budgets: Sequence[tuple[int, int]],
    field: str,
    prompt_tokens: int,
    max_tokens: int | None = None,
) -> ContextTooLong | None:
    """`check_kv_budgets`'s error, or None where a budget holds `need` tokens."""
    largest = largest_kv_budget(kv_budgets)
    if largest[0] and need > largest[0] * largest[1]:
        tokens = largest[0] * largest[1]
        return ContextTooLong(field, prompt_tokens, max_tokens, tokens, kv_blocks=largest)
    return None


def largest_kv_budget(kv_budgets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (num_blocks, block_size) that holds the most tokens ((0, 0): none known)."""
    return max(kv_budgets, default=(0, 0), key=lambda budget: budget[0] * budget[1])
