"""The context-length 400, in the API's words rather than the fleet's.

The gateway asks the fleet to keep room for `max_tokens` (OpenAI's rule), and
words the fleet's `ContextTooLong` as OpenAI and vLLM do: "This model's
maximum context length is N tokens. However, you requested M tokens (P in the
messages, C in the completion). ...", code `context_length_exceeded`, `param`
naming the prompt's field (`messages`, or `prompt` for legacy completions).
Without `max_tokens` (chat) an answer may run to the end of the context, so
then only the prompt must leave room for one token.
"""

from __future__ import annotations

from mlx_worker_svc.fleet import ContextTooLong
from mlx_worker_svc.gateway.errors import ApiError
from mlx_worker_svc.gateway.schema import Kind


def context_error(kind: Kind, exc: ContextTooLong) -> ApiError:
    """The OpenAI error for a request that does not fit the context."""
    where = "messages" if kind == "chat" else "prompt"
    message = f"This model's maximum context length is {exc.context_length} tokens. However, "
    if exc.max_tokens is None:
        message += (
            f"your {where} resulted in {exc.prompt_tokens} tokens. "
            f"Please reduce the length of the {where}."
        )
    else:
        message += (
            f"you requested {exc.prompt_tokens + exc.max_tokens} tokens "
            f"({exc.prompt_tokens} in the {where}, {exc.max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion."
        )
    return ApiError(400, message, param=where, code="context_length_exceeded")
