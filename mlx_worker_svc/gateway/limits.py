"""The model's limits (context length, vocabulary) as 400s in the API's words, not the fleet's.

The OpenAI routes ask the fleet to keep room for `max_tokens` (OpenAI's rule),
and word the fleet's `ContextTooLong` as OpenAI and vLLM do: "This model's
maximum context length is N tokens. However, you requested M tokens (P in the
messages, C in the completion). ...", code `context_length_exceeded`, `param`
naming the prompt's field (`messages`, or `prompt` for legacy completions).
Without `max_tokens` (chat) an answer may run to the end of the context, so
then only the prompt must leave room for one token. `/v1/messages` reserves
no `max_tokens` (Anthropic's rule: the answer stops at the end of the context,
`model_context_window_exceeded`), and words a prompt with no room left as
Anthropic does: "prompt is too long: P tokens > M maximum". A token id out of
the vocabulary (`OutOfVocabulary`) names the request field that holds it.
"""

from __future__ import annotations

from mlx_worker_svc.fleet import ContextTooLong, OutOfVocabulary, PromptTooLarge
from mlx_worker_svc.gateway.errors import ApiError, invalid
from mlx_worker_svc.gateway.schema import Kind

# The fleet's name of a field holding token ids -> the API's.
_PARAMS = {
    "prompt_token_ids": "prompt",
    "sampling_params.logit_bias": "logit_bias",
    "sampling_params.stop_token_ids": "stop_token_ids",
}


def limit_error(kind: Kind, exc: ContextTooLong | OutOfVocabulary | PromptTooLarge) -> ApiError:
    """The OpenAI error for a request past the model's context or vocabulary."""
    if isinstance(exc, OutOfVocabulary):
        param = _PARAMS.get(exc.field, exc.field)
        return invalid(param, f"token {exc.token} is out of the vocabulary (size {exc.vocab_size})")
    if isinstance(exc, PromptTooLarge):
        return _too_large(kind, exc)
    if kind == "messages":  # Anthropic's words; its max_tokens is not reserved
        most = exc.context_length - 1
        return _context_error(
            kind,
            exc.context_length,
            f"{exc.prompt_tokens} tokens > {most} maximum (the model's context is "
            f"{exc.context_length} tokens, one of them for the answer)",
        )
    where = _where(kind)
    if exc.max_tokens is None:
        return _context_error(
            kind,
            exc.context_length,
            f"your {where} resulted in {exc.prompt_tokens} tokens. "
            f"Please reduce the length of the {where}.",
        )
    return _context_error(
        kind,
        exc.context_length,
        f"you requested {exc.prompt_tokens + exc.max_tokens} tokens "
        f"({exc.prompt_tokens} in the {where}, {exc.max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.",
    )


def _too_large(kind: Kind, exc: PromptTooLarge) -> ApiError:
    """A prompt's text past what a worker takes in one message, worded as the context
    error each API's clients compact on ("prompt is too long", context_length_exceeded):
    it is longer than any prompt the model's context holds."""
    past = (
        f"{exc.size} bytes of text, more than a worker tokenizes in one message "
        f"({exc.max_message} bytes, sized to the model's context of {exc.context_length} "
        "tokens)"
    )
    if kind == "messages":
        return _context_error(kind, exc.context_length, past)
    where = _where(kind)
    verb = "is" if where == "prompt" else "are"
    return _context_error(
        kind,
        exc.context_length,
        f"your {where} {verb} {past}. Please reduce the length of the {where}.",
    )


def _where(kind: Kind) -> str:
    return "prompt" if kind == "completion" else "messages"


def _context_error(kind: Kind, context_length: int, detail: str) -> ApiError:
    """The context error in the words each API's clients compact on: Anthropic's
    "prompt is too long: DETAIL", OpenAI's context_length_exceeded."""
    if kind == "messages":
        return ApiError(400, f"prompt is too long: {detail}", param="messages")
    message = f"This model's maximum context length is {context_length} tokens. However, {detail}"
    return ApiError(400, message, param=_where(kind), code="context_length_exceeded")
