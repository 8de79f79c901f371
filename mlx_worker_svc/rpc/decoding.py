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

A request stream is checked message by message. The message type is the
method's input type in the default descriptor pool (the handler's own class
otherwise). Install the interceptor after the metrics one, so that the refusal
is counted with its code.
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
    """What a checked deserializer returns for bytes that do not parse."""

    details: str
    """The status message: the message type and what is wrong."""


def check_deserializer(method: str, deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer` returning an `Undecodable` instead of raising `DecodeError`."""

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(_details(_input_type(method, deserializer), data, exc))

    return deserialize


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


def bad_utf8_path(descriptor: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The path of the first `string` field in `data` that is not UTF-8, if any.

    Walks the wire format by the descriptor ("new_requests[2].req_id",
    "a key of num_scheduled_tokens"); None when none is found before the bytes
    end or stop making sense.
    """
    seen: Counter[int] = Counter()
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                pos = _varint(data, pos)[1]
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None  # groups or garbage: nothing these protocols use
            size, pos = _varint(data, pos)
            chunk, pos = data[pos : pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if pos > len(data) or field is None:
                continue
            index = seen[number]
            seen[number] += 1
            found = _bad_utf8_in(field, chunk, depth)
            if found is not None:
                return _path(field, index, found)
    except _Corrupt:
        return None
    return None


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
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        return f"a key of {field.name}" if inner == "key" else f"a {field.name} value"
    name = f"{field.name}[{index}]" if field.is_repeated else field.name
    return f"{name}.{inner}" if inner else name


# ------------------------------------------------------------ interceptors


def _log(method: str, request: Undecodable) -> None:
    fields = {"rpc": method, "code": "INVALID_ARGUMENT", "error": request.details}
    log.info("rpc failed", extra=fields)


def _refuse(method: str, context: grpc.ServicerContext, request: Undecodable) -> NoReturn:
    _log(method, request)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


async def _refuse_async(
    method: str, context: grpc.aio.ServicerContext[Any, Any], request: Undecodable
) -> NoReturn:
    _log(method, request)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


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
                if isinstance(request, Undecodable):
                    _refuse(method, context, request)
                yield request

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
