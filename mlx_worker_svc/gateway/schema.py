"""OpenAI request bodies in, a fleet `GenerateRequest` out, or an `ApiError` naming the field.

Chat (`/v1/chat/completions`) and legacy completions (`/v1/completions`) share
the sampling fields (temperature, top_p, seed, stop, max_tokens, penalties,
logit_bias) and add their own prompt and logprobs shapes. vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids) are honoured too, since the workers take vLLM's parameters,
and so are the structured-output fields (structured.py) and chat's tool fields
(tools.py). Like OpenAI, an argument the endpoint does not know is a 400, and
one it knows but cannot honour (echo, suffix) is a 400 that says so, never
silently ignored (`n` choices are n fleet requests: choices.py). A body that
is not JSON in UTF-8 (RFC 8259), nests past the parser's depth or holds a lone
surrogate escape is a 400 too (`body.parse_body`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mlx_worker_svc.gateway.body import Fields, json_type, only_keys
from mlx_worker_svc.gateway.errors import ApiError, invalid
from mlx_worker_svc.gateway.sampling import UINT32, openai_sampling
from mlx_worker_svc.gateway.structured import FIELDS, apply_spec, parse_structured
from mlx_worker_svc.gateway.tools import ToolRequest, check_tool_answers, history, parse_tools
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

OpenAIKind = Literal["chat", "completion"]
Kind = OpenAIKind | Literal["messages"]  # messages: Anthropic's (anthropic/schema.py)
MAX_LOGPROBS = 20  # the workers' bound on top-n
MAX_N = 128  # OpenAI's bound on `n` (each choice is a fleet request: choices.py)
_ROLES = {"system", "user", "assistant", "tool", "developer"}
# A message's fields: what OpenAI takes, and what clients send back of an answer, read
# as nothing: `annotations`, the openai SDK's `parsed` (its parse() and stream()
# helpers' messages) and vLLM's `reasoning*` (the models here do not reason).
_MESSAGE_KEYS = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "refusal",
    "annotations",
    "parsed",
    "reasoning_content",
    "reasoning",
    "audio",
    "function_call",
)
# Fields known to OpenAI that cannot be honoured unless null.
_MESSAGE_UNSUPPORTED = {
    "audio": "audio in the history is not supported by this server",
    "function_call": "function calls are not supported by this server (use tool_calls)",
}
# A content part's fields by type (`cache_control`, as some clients add for Anthropic
# models, changes nothing: the workers' prefix cache reuses every prompt).
_PART_KEYS = {"text": ("type", "text", "cache_control"), "refusal": ("type", "refusal")}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


@dataclass(frozen=True)
class ParsedRequest:
    """What one OpenAI request asks of the fleet, and how to answer it."""

    kind: Kind
    id: str  # the response id, also the fleet request id
    model: str | None
    generate: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs; else how many alternatives per token
    tools: ToolRequest  # chat's tool fields (legacy completions have none)
    structured_param: str | None = None  # the request field of sampling_params.structured_outputs
    # A JSON answer's schema beside tools the model may call (it calls them or answers so).
    answer_schema: dict[str, Any] | None = None
    n: int = 1  # choices, each a fleet request of its own (choices.fan_out)


# Chat fields OpenAI takes that change nothing here, each with the values it takes:
# caching, routing and abuse-tracking hints, and reasoning knobs for models that do
# not reason here (vLLM accepts them too).
_HINTS: dict[str, tuple[str, ...] | None] = {
    "service_tier": ("auto", "default", "flex", "scale", "priority", "fast"),
    "prompt_cache_key": None,  # any string
    "prompt_cache_retention": ("in_memory", "in-memory", "24h"),
    "safety_identifier": None,
    "reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "verbosity": ("low", "medium", "high"),
}
# Fields both endpoints read; the sets below add each endpoint's own.
_COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    *FIELDS,
}
_KNOWN: dict[OpenAIKind, set[str]] = {
    "chat": _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "metadata",
        "store",
        "modalities",
        *_HINTS,
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    "completion": _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
}
# Known to OpenAI, not honoured here: a 400 that says why (None/absent is fine).
_UNSUPPORTED = {
    "functions": "function calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
}


def parse_request(kind: OpenAIKind, body: Any, id_base: str) -> ParsedRequest:
    """Validates an OpenAI request body; raises `ApiError` (400) naming the bad field.
    The answer's id is built on `id_base` (request_ids.base)."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    for name in body:
        if name in _UNSUPPORTED and body[name] is not None:
            raise ApiError(400, f"'{name}': {_UNSUPPORTED[name]}", param=name)
        if name not in _KNOWN[kind] and name not in _UNSUPPORTED:
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unrecognized_argument",
            )
    fields = Fields(body)
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"expected a string, got {json_type(model)}")
    n = fields.integer("n", 1, MAX_N) or 1
    _ignored(kind, fields)
    stream = fields.boolean("stream")
    include_usage = _stream_options(fields, stream)
    request = pb.GenerateRequest(
        sampling_params=openai_sampling(kind, fields), request_id=_new_id(kind, id_base)
    )
    tools = ToolRequest()
    if kind == "chat":
        request.messages.extend(_messages(fields.get("messages")))
        tools = parse_tools(body)
        logprobs = _chat_logprobs(fields)
    else:
        _completion_prompt(fields.get("prompt"), request)
        logprobs = fields.integer("logprobs", 0, MAX_LOGPROBS)
        if fields.boolean("echo"):
            raise ApiError(400, "'echo' is not supported by this server", param="echo")
        _best_of(fields.integer("best_of", 1, MAX_N), n)
        suffix = fields.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise invalid("suffix", f"expected a string, got {json_type(suffix)}")
        if suffix:
            raise ApiError(400, "'suffix' is not supported by this server", param="suffix")
    if logprobs is not None:
        request.sampling_params.logprobs = logprobs
    spec, structured_param = parse_structured(body)
    param = structured_param or ""
    answer_schema = apply_spec(request.sampling_params, spec, param, tools=tools.may_call)
    return ParsedRequest(
        kind=kind,
        id=request.request_id,
        model=model,
        generate=request,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        tools=tools,
        structured_param=structured_param,
        answer_schema=answer_schema,
        n=n,
    )


def _best_of(best_of: int | None, n: int) -> None:
    """Legacy `best_of`: answers made to return the best `n` of; only all of them can be."""
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise invalid("best_of", f"must be at least n ({n}), got {best_of}")
    raise ApiError(
        400,
        f"Only best_of = n is supported (every answer is returned; got best_of {best_of}, "
        f"n {n}): ranking answers is not",
        param="best_of",
        code="invalid_value",
    )


def _ignored(kind: OpenAIKind, fields: Fields) -> None:
    """Type-checks the fields accepted and ignored: `user`, chat's `store` and `metadata`,
    and `modalities` (["text"], what every answer is, or refused)."""
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"expected a string, got {json_type(user)}")
    if kind != "chat":
        return
    fields.boolean("store")
    modalities = fields.get("modalities")
    if modalities is not None and modalities != ["text"]:  # text is the default output
        raise invalid(
            "modalities", 'only text output is supported by this server: give ["text"] or none'
        )
    for name, allowed in _HINTS.items():
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, f"expected a string, got {json_type(value)}")
        if value is not None and allowed is not None and value not in allowed:
            raise invalid(name, f"{value!r} is not one of {list(allowed)}")
    metadata = fields.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid("metadata", f"expected an object, got {json_type(metadata)}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise invalid(f"metadata.{key}", f"expected a string, got {json_type(value)}")


def _new_id(kind: OpenAIKind, id_base: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{id_base}"


def _stream_options(fields: Fields, stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "only allowed when 'stream' is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", f"expected an object, got {json_type(options)}")
    only_keys(options, _STREAM_OPTIONS, "stream_options")
    fields = Fields(options, "stream_options")
    fields.boolean("include_obfuscation")  # no obfuscation padding is sent either way
    if fields.boolean("continuous_usage_stats"):
        raise ApiError(
            400,
            "'stream_options.continuous_usage_stats' is not supported by this server: "
            "'include_usage' sends the usage in a last chunk",
            param="stream_options.continuous_usage_stats",
            code="invalid_value",
        )
    return fields.boolean("include_usage")


def _messages(value: Any) -> list[pb.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "expected a non-empty array of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"expected an object, got {json_type(message)}")
        only_keys(message, _MESSAGE_KEYS, where)
        for name, why in _MESSAGE_UNSUPPORTED.items():
            if message.get(name) is not None:
                raise invalid(f"{where}.{name}", why)
        role = message.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role", f"{role!r} is not one of {sorted(_ROLES)}")
        if message.get("content") is None and role != "assistant":
            raise invalid(f"{where}.content", f"a {role} message needs its content")
        # "developer" is OpenAI's newer name for "system", which chat templates know.
        content = _content(message.get("content"), where, role)
        refusal = message.get("refusal")  # an assistant's earlier refusal, as the SDK sends it
        if refusal is not None:
            if role != "assistant" or not isinstance(refusal, str):
                raise invalid(f"{where}.refusal", "expected a string, on an assistant message")
            content = "\n".join(text for text in (content, refusal) if text)
        role = "system" if role == "developer" else role
        out.append(pb.ChatMessage(role=role, content=content, **history(message, where)))
    check_tool_answers(value)
    return out


def _content(value: Any, where: str, role: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid(f"{where}.content", "expected a string or an array of text parts")
    if not value:
        raise invalid(f"{where}.content", "empty array: expected at least one content part")
    texts = []
    for j, part in enumerate(value):
        # An assistant's earlier refusal comes back as a part of its own, as OpenAI's do.
        kind = "refusal" if role == "assistant" and _type(part) == "refusal" else "text"
        if _type(part) != kind:
            raise invalid(f"{where}.content[{j}]", "only text parts are supported")
        only_keys(part, _PART_KEYS[kind], f"{where}.content[{j}]")
        if not isinstance(part.get(kind), str):
            raise invalid(f"{where}.content[{j}].{kind}", "expected a string")
        texts.append(part[kind])
    return "\n".join(texts)


def _type(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else None


def _chat_logprobs(fields: Fields) -> int | None:
    top = fields.integer("top_logprobs", 0, MAX_LOGPROBS)
    if not fields.boolean("logprobs"):
        if top:
            raise invalid("top_logprobs", "requires 'logprobs' to be true")
        return None
    return top or 0


def _completion_prompt(value: Any, request: pb.GenerateRequest) -> None:
    """A string, one string in an array, or token ids (an array of integers)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        request.prompt = value
        return
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32 for t in value)
    ):
        request.prompt_token_ids.extend(value)
        return
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
        raise ApiError(400, "Only one prompt per request is supported", param="prompt")
    raise invalid("prompt", "expected a non-empty string or an array of token ids")
