"""What the fleet refuses or fails a request with; each error's `code` is the status callers get."""

from __future__ import annotations

from mlx_worker_svc.core.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    WorkerError,
)


class FleetError(WorkerError):
    """A request the fleet cannot take; `code` is the status callers get."""


class Overloaded(FleetError, ResourceExhausted):
    """The queue is full."""


class NoWorkers(FleetError, Unavailable):
    """No worker (of the request's model) is up (in time)."""


class LoadFailed(FleetError, Unavailable):
    """The request's model could not be loaded on the worker chosen for it."""


class ShuttingDown(FleetError, Unavailable):
    """The fleet is draining (SIGTERM): it takes no new request."""

    def __init__(self) -> None:
        super().__init__("the fleet is shutting down: send the request to another fleet")


class ShutDown(FleetError, Aborted):
    """The fleet stopped before the request finished (its grace period ran out)."""

    def __init__(self, *, cut: bool = False) -> None:
        why = "a second stop signal cut the drain short" if cut else "its --grace-seconds ran out"
        super().__init__(f"the fleet shut down before the request finished ({why})")


class BadRequest(FleetError, InvalidArgument):
    """The request is malformed."""


class ModelNotFound(FleetError, NotFound):
    """GenerateRequest.model names no model of the fleet."""

    def __init__(self, model: str, known: list[str]) -> None:
        served = ", ".join(repr(name) for name in known) or "none yet"
        super().__init__(f"model: the fleet serves no model {model!r} (it serves {served})")
        self.model = model


class ContextTooLong(BadRequest):
    """The prompt (`field`: the request's form of it; with room for `max_tokens`, when
    asked) does not fit the model's context."""

    def __init__(
        self,
        field: str,
        prompt_tokens: int,
        max_tokens: int | None,
        context_length: int,
        *,
        kv_blocks: tuple[int, int] | None = None,
    ) -> None:
        """`kv_blocks` (num_blocks, block_size): the limit is the largest KV budget of a
        worker of the model, shorter than its context."""
        asked = f" and max_tokens is {max_tokens}" if max_tokens is not None else ""
        limit = f"the model's context length is {context_length} tokens"
        if kv_blocks is not None:
            limit = (
                f"the largest KV budget of a worker of the model holds {context_length} tokens "
                f"({kv_blocks[0]} blocks of {kv_blocks[1]}), less than its context"
            )
        super().__init__(f"{field}: the prompt has {prompt_tokens} tokens{asked}; {limit}")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class Outgrew(FleetError, ResourceExhausted):
    """A request that ran (moving off a lost worker) fits no worker of its model now."""

    def __init__(self, prompt_tokens: int, generated: int, kv_blocks: tuple[int, int]) -> None:
        blocks, size = kv_blocks
        super().__init__(
            f"the request outgrew the KV budget of every worker of its model: its "
            f"{prompt_tokens + generated} tokens ({prompt_tokens} of the prompt, {generated} "
            f"generated) and the next do not fit the largest, {blocks * size} tokens "
            f"({blocks} blocks of {size}); ask for fewer tokens (max_tokens), or give the "
            "workers more KV"
        )


class PromptTooLarge(BadRequest):
    """The prompt's text (`field`) is more bytes than a worker of the model takes in one
    message, which is sized to its context: longer than any prompt it serves."""

    def __init__(self, field: str, size: int, max_message: int, context_length: int) -> None:
        super().__init__(
            f"{field}: {size} bytes of text, more than a worker of the model tokenizes in one "
            f"message ({max_message} bytes, sized to its context): longer than any prompt "
            "it serves"
        )
        self.field = field
        self.size = size
        self.max_message = max_message
        self.context_length = context_length


class OutOfVocabulary(BadRequest):
    """A token id of the request (`field` names where) is not in the model's vocabulary."""

    def __init__(self, field: str, token: int, vocab_size: int) -> None:
        super().__init__(f"{field}: token {token} is out of the vocabulary (size {vocab_size})")
        self.field, self.token, self.vocab_size = field, token, vocab_size
