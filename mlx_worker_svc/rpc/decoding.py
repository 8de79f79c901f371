"""Requests whose bytes do not parse are INVALID_ARGUMENT, naming the message type.

grpcio runs a method's request deserializer before any handler code; when it
raises (invalid UTF-8 in a proto3 `string`, truncated or garbage bytes), grpcio
logs "Exception deserializing request!" with a traceback and answers INTERNAL,
which reads as a server bug and tells the client nothing. `DecodeInterceptor`
(synchronous `grpc.server`) and `AsyncDecodeInterceptor` (`grpc.aio`) give every
method, health and reflection included, a deserializer that returns an
`Undecodable` instead of raising, and a behaviour that refuses one with
INVALID_ARGUMENT and a single log line, no traceback:

    the request bytes do not decode as mlx_worker.v1.ExecuteRequest:
    new_requests[0].req_id is not valid UTF-8

A request stream is checked message by message: one that does not decode
ends the call, but on the synchronous server one that parsed and sets a
field this server does not know reaches the handler as an `Undecodable`
carrying the message (`parsed`), so that a stream answering each message
(ExecuteStream) can refuse that one message and go on; such a handler must
check for it. The message type is the method's input type in the default
descriptor pool (the handler's own class otherwise). Install the interceptor
after the metrics one, so that the refusal is counted with its code.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import grpc.aio
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from mlx_worker_svc.rpc.metrics import rebuild_handler

if TYPE_CHECKING:
    from mlx_worker_svc.rpc.metrics import Handler

log = logging.getLogger(__name__)

_MAX_DEPTH = 100  # protobuf's own limit on nested messages


@dataclass(frozen=True)
class Undecodable:
    """What a checked deserializer returns for bytes that do not parse, or that set a
    field this server does not know."""

    details: str
    """The status message: the message type and what is wrong."""
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    parsed: Any = None
    """The message, its unknown fields dropped, when the bytes parsed (an unknown field)."""


OWN_PACKAGE = "/mlx_worker."
"""The services whose requests may set no field the server does not know."""


def check_deserializer(method: str, deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer` returning an `Undecodable` instead of raising `DecodeError`, and,
    for this project's services, for a request that sets a field unknown here (a
    client built from a newer proto: protobuf would drop its value unseen)."""
    strict = method.startswith(OWN_PACKAGE)

    def deserialize(data: bytes) -> Any:
        try:
            message = deserializer(data)
        except DecodeError as exc:
            return Undecodable(_details(_input_type(method, deserializer), data, exc))
        if strict:
            message.DiscardUnknownFields()
            if message.ByteSize() != len(data):  # unknown fields, or an unusual encoding
                unknown = _unknown(_input_type(method, deserializer), data, message)
                if unknown is not None:
                    return unknown
        return message

    return deserialize


def _unknown(descriptor: Descriptor | None, data: bytes, message: Any) -> Undecodable | None:
    path = None if descriptor is None else unknown_field_path(descriptor, data)
    if descriptor is None or path is None:
        return None
    if "wire type " in path:  # a known field written as another type: a corrupt request
        return Undecodable(f"the request bytes do not decode as {descriptor.full_name}: {path}")
    return Undecodable(
        f"{descriptor.full_name}: {path} is not a field this server knows (a client "
        f"built from a newer proto?): leave it unset, or upgrade the server",
        grpc.StatusCode.UNIMPLEMENTED,
        parsed=message,
    )


def _input_type(method: str, deserializer: Callable[[bytes], Any]) -> Descriptor | None:
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        found = descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]
        return found.input_type
    except KeyError:
        owner = getattr(deserializer, "__self__", None)  # a generated class's FromString
        described = getattr(owner, "DESCRIPTOR", None)
        return described if isinstance(described, Descriptor) else None


def _details(descriptor: Descriptor | None, data: bytes, exc: DecodeError) -> str:
    what = descriptor.full_name if descriptor is not None else "the method's request type"
    path = None if descriptor is None else bad_utf8_path(descriptor, data)
    if path is not None:
        reason = f"{path} is not valid UTF-8"
    else:
        # upb says "Error parsing message with type 'X': Wire format was corrupt".
        reason = str(exc).rpartition("': ")[2] or type(exc).__name__
    return f"the request bytes do not decode as {what}: {reason}"


# ------------------------------------------------------------ the wire format


class _Corrupt(Exception):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Corrupt


Visit = Callable[[FieldDescriptor | None, int, bytes | None, int, int], str | None]
_GROUP = (3, 4)  # start and end of a group: no field of these protocols is one


def _walk(descriptor: Descriptor, data: bytes, visit: Visit) -> str | None:
    """Walks the wire format of `data` by `descriptor`, calling `visit(field, number,
    chunk, index, wire_type)` on each field (`field` None for a number the descriptor
    lacks, `chunk` None but for length-delimited ones, `index` its count so far); returns
    the first path a visit gives, or None when none does before the bytes end or stop
    making sense. A group is visited, then the walk stops (these protocols have none)."""
    seen: Counter[int] = Counter()
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            chunk = None
            if wire_type == 0:
                pos = _varint(data, pos)[1]
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
            elif wire_type not in _GROUP:
                return None  # garbage
            if pos > len(data):
                return None
            field = descriptor.fields_by_number.get(number)
            index = seen[number]
            seen[number] += 1
            found = visit(field, number, chunk, index, wire_type)
            if found is not None or wire_type in _GROUP:
                return found
    except _Corrupt:
        return None
    return None


def bad_utf8_path(descriptor: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The path of the first `string` field in `data` that is not UTF-8, if any
    ("new_requests[2].req_id", "num_scheduled_tokens (a key)")."""

    def visit(
        field: FieldDescriptor | None, _n: int, chunk: bytes | None, index: int, _wire: int
    ) -> Any:
        if field is None or chunk is None:
            return None
        found = _bad_utf8_in(field, chunk, depth)
        return None if found is None else _path(field, index, found)

    return _walk(descriptor, data, visit)


# The wire type of each field type (a repeated number may also come packed: 2).
_WIRE = {
    FieldDescriptor.TYPE_DOUBLE: 1, FieldDescriptor.TYPE_FIXED64: 1,
    FieldDescriptor.TYPE_SFIXED64: 1, FieldDescriptor.TYPE_FLOAT: 5,
    FieldDescriptor.TYPE_FIXED32: 5, FieldDescriptor.TYPE_SFIXED32: 5,
    FieldDescriptor.TYPE_STRING: 2, FieldDescriptor.TYPE_BYTES: 2,
    FieldDescriptor.TYPE_MESSAGE: 2,
}  # fmt: skip


def _fits_wire(field: FieldDescriptor, wire_type: int) -> bool:
    expected = _WIRE.get(field.type, 0)  # the varints: ints, bools, enums
    return wire_type == expected or (wire_type == 2 and expected != 2 and field.is_repeated)


def unknown_field_path(descriptor: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The path of the first field in `data` that `descriptor` does not define
    ("new_requests[0].sampling_params.field 42"), or that comes in another wire type
    than its type's (protobuf keeps it aside, unread, as it keeps an unknown one), if any."""

    def visit(
        field: FieldDescriptor | None, number: int, chunk: bytes | None, index: int, wire: int
    ) -> Any:
        if field is None:
            return f"field {number}"
        if not _fits_wire(field, wire):
            return f"{field.name} (wire type {wire}, not its type's)"
        message = field.message_type
        if chunk is None or message is None or depth >= _MAX_DEPTH:
            return None
        found = unknown_field_path(message, chunk, depth + 1)
        return None if found is None else _path(field, index, found)

    return _walk(descriptor, data, visit)


def _bad_utf8_in(field: FieldDescriptor, chunk: bytes, depth: int) -> str | None:
    """ "" when `chunk` is the field's own bad string, a sub-path, or None."""
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return ""
        return None
    message = field.message_type
    if message is not None and depth < _MAX_DEPTH:
        return bad_utf8_path(message, chunk, depth + 1)
    return None


def _path(field: FieldDescriptor, index: int, inner: str) -> str:
    """`field`'s path with the `inner` path within it: "new_requests[2].req_id", and for
    a map, what in one of its entries: "num_scheduled_tokens (a key)", "logit_bias (a
    value, wire type 2, not its type's)", "grammar_bitmask (an entry's field 3)"."""
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        part, _, rest = inner.partition(" ")
        part, _, within = part.partition(".")
        if part in ("key", "value"):
            what = f"a {part}" + (f"'s {within}" if within else "")
            return f"{field.name} ({what}{', ' + rest.strip('()') if rest else ''})"
        return f"{field.name} (an entry's {inner})"
    name = f"{field.name}[{index}]" if field.is_repeated else field.name
    return f"{name}.{inner}" if inner else name


# ------------------------------------------------------------ interceptors


def _log(method: str, request: Undecodable) -> None:
    # `rpc` as the servicer's own failure lines name it: the method alone.
    name = method.rsplit("/", 1)[-1]
    fields = {"rpc": name, "code": request.code.name, "error": request.details}
    log.info("rpc failed", extra=fields)


def _refuse(method: str, context: grpc.ServicerContext, request: Undecodable) -> NoReturn:
    _log(method, request)
    context.abort(request.code, request.details)


async def _refuse_async(
    method: str, context: grpc.aio.ServicerContext[Any, Any], request: Undecodable
) -> NoReturn:
    _log(method, request)
    await context.abort(request.code, request.details)


class DecodeInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The decode check for a synchronous `grpc.server` (the worker)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method

        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, Undecodable) and request.parsed is None:
                    _refuse(method, context, request)
                yield request  # one that parsed: the handler refuses that message alone

        def wrap(behavior: Callable[..., Any], _streaming: bool) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, Undecodable):
                    _refuse(method, context, request)
                if handler.request_streaming:
                    request = checked(request, context)
                return behavior(request, context)

            return call

        deserializer = check_deserializer(method, handler.request_deserializer)
        return rebuild_handler(handler, wrap, request_deserializer=deserializer)


class AsyncDecodeInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """The decode check for `grpc.aio.server` (the fleet); its handlers are coroutines."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        streaming_request = handler.request_streaming

        async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await _refuse_async(method, context, request)
                yield request

        async def admit(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await _refuse_async(method, context, request)
            return checked(request, context) if streaming_request else request

        def wrap(behavior: Callable[..., Any], _streaming: bool) -> Callable[..., Any]:
            if inspect.isasyncgenfunction(behavior):

                async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                    async for response in behavior(await admit(request, context), context):
                        yield response

                return stream

            async def call(request: Any, context: Any) -> Any:
                return await behavior(await admit(request, context), context)

            return call

        if not all(
            inspect.iscoroutinefunction(b) or inspect.isasyncgenfunction(b)
            for b in _behaviors(handler)
        ):
            return handler  # a synchronous behaviour could not await the refusal
        deserializer = check_deserializer(method, handler.request_deserializer)
        return rebuild_handler(handler, wrap, request_deserializer=deserializer)


def _behaviors(handler: Handler) -> list[Callable[..., Any]]:
    kinds = (handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream)
    return [b for b in kinds if b is not None]
