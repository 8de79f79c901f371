"""Undecodable gRPC requests, built from the descriptors, and a sender for raw bytes.

`corpus(services)` makes, for every method of the named services, one request
per string field of its input type (nested messages, repeated fields and map
keys and values included) with that field's bytes replaced by each kind of
invalid UTF-8 in `BAD_UTF8`, plus truncated and random bytes that do not
parse. Each `Bad` carries the end of the status message the server must give
(the field's path as the server names it, for bad UTF-8). `run_corpus` sends
them with identity serializers and returns the answers that are not
INVALID_ARGUMENT naming the message type (and the field).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message

from mlx_worker_svc.rpc.reflection import v1_file

Code = grpc.StatusCode
TIMEOUT = 30.0
PLACEHOLDER = "<placeholder>"  # replaced, byte for byte, by invalid UTF-8
# Invalid UTF-8: a bare continuation byte, 0xff, an overlong '/', an encoded
# surrogate, a sequence cut short, a code point past U+10FFFF.
BAD_UTF8 = (b"\x80", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82x", b"\xf4\x90\x80\x80")


@dataclass(frozen=True)
class Bad:
    """One undecodable request: where it goes, its bytes, the status message it must get."""

    method: MethodDescriptor
    data: bytes
    kind: str  # "utf8", "truncated" or "random"
    expect: str  # the end of the status message, after the message type

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"


Setter = Callable[[Message], None]


def string_fields(
    descriptor: Descriptor, seen: tuple[str, ...] = ()
) -> Iterator[tuple[str, Setter]]:
    """(path as the server names it, a setter writing PLACEHOLDER there) for every string field."""
    within = (*seen, descriptor.full_name)  # a recursive message is followed once
    for field in descriptor.fields:
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            yield from _map_fields(field, message)
        elif field.type == FieldDescriptor.TYPE_STRING:
            yield _string_field(field)
        elif message is not None and message.full_name not in within:
            for inner, setter in string_fields(message, within):
                yield _nested(field, inner, setter)


def _string_field(field: FieldDescriptor) -> tuple[str, Setter]:
    if field.is_repeated:
        return f"{field.name}[0]", lambda m: getattr(m, field.name).append(PLACEHOLDER)
    return field.name, lambda m: setattr(m, field.name, PLACEHOLDER)


def _nested(field: FieldDescriptor, inner: str, setter: Setter) -> tuple[str, Setter]:
    if field.is_repeated:
        return f"{field.name}[0].{inner}", lambda m: setter(getattr(m, field.name).add())
    return f"{field.name}.{inner}", lambda m: setter(getattr(m, field.name))


def _map_fields(field: FieldDescriptor, entry: Descriptor) -> Iterator[tuple[str, Setter]]:
    key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
    if key.type == FieldDescriptor.TYPE_STRING:
        yield (
            f"{field.name} (a key)",
            lambda m: getattr(m, field.name).__setitem__(PLACEHOLDER, value.default_value),
        )
    some_key = "k" if key.type == FieldDescriptor.TYPE_STRING else 1
    if value.type == FieldDescriptor.TYPE_STRING:
        yield (
            f"{field.name} (a value)",
            lambda m: getattr(m, field.name).__setitem__(some_key, PLACEHOLDER),
        )
    elif value.message_type is not None:
        for inner, setter in string_fields(value.message_type):
            yield f"{field.name} (a value's {inner})", _in_map_value(field.name, some_key, setter)


def _in_map_value(name: str, key: str | int, setter: Setter) -> Setter:
    return lambda m: setter(getattr(m, name)[key])


def _message(method: MethodDescriptor) -> Message:
    return message_factory.GetMessageClass(method.input_type)()


def _decodes(method: MethodDescriptor, data: bytes) -> bool:
    try:
        _message(method).ParseFromString(data)
    except DecodeError:
        return False
    return True


_NUMBERS = {
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
}


def _fill_numbers(message: Message) -> None:
    """Sets the top-level integer fields to a value of several bytes (more places to cut)."""
    for field in message.DESCRIPTOR.fields:
        if field.type in _NUMBERS and not field.is_repeated and field.containing_oneof is None:
            setattr(message, field.name, 300)


def corpus(services: tuple[str, ...], seed: int) -> list[Bad]:
    """Each kind of bad UTF-8 in each string field, truncated and random bytes, every method."""
    v1_file()
    pool = descriptor_pool.Default()
    rng = random.Random(seed)
    bad: list[Bad] = []
    for service in services:
        for method in pool.FindServiceByName(service).methods:
            full = _message(method)
            for path, setter in string_fields(method.input_type):
                request = _message(method)
                setter(request)
                setter(full)
                data = request.SerializeToString()
                assert data.count(PLACEHOLDER.encode()) == 1, (method.full_name, path)
                for junk in BAD_UTF8:
                    wrong = data.replace(PLACEHOLDER.encode(), junk.ljust(len(PLACEHOLDER), b"x"))
                    bad.append(Bad(method, wrong, "utf8", f"{path} is not valid UTF-8"))
            _fill_numbers(full)
            whole = full.SerializeToString().replace(PLACEHOLDER.encode(), b"x" * len(PLACEHOLDER))
            cuts = [n for n in range(1, len(whole)) if not _decodes(method, whole[:n])]
            for n in cuts[:: max(1, len(cuts) // 3)][:3]:
                bad.append(Bad(method, whole[:n], "truncated", ""))
            junk_found = 0
            while junk_found < 2:
                data = rng.randbytes(rng.randint(1, 48))
                if not _decodes(method, data):
                    bad.append(Bad(method, data, "random", ""))
                    junk_found += 1
    return bad


def send(channel: grpc.Channel, bad: Bad) -> tuple[Code, str]:
    """Sends the raw bytes; returns the status code and message."""
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    try:
        if bad.method.client_streaming:
            call = channel.stream_stream(bad.path, identity, identity)
            list(call(iter([bad.data]), timeout=TIMEOUT))
        elif bad.method.server_streaming:
            list(channel.unary_stream(bad.path, identity, identity)(bad.data, timeout=TIMEOUT))
        else:
            channel.unary_unary(bad.path, identity, identity)(bad.data, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    return Code.OK, ""


def run_corpus(channel: grpc.Channel, bad: list[Bad], where: str) -> list[tuple[Any, ...]]:
    """Sends every request; prints the codes seen, by kind; returns the wrong answers."""
    seen: Counter[str] = Counter()
    wrong: list[tuple[Any, ...]] = []
    for b in bad:
        code, details = send(channel, b)
        seen[f"{b.kind} {code.name}"] += 1
        prefix = f"the request bytes do not decode as {b.method.input_type.full_name}: "
        right = code == Code.INVALID_ARGUMENT and details.startswith(prefix)
        if not right or not details.endswith(b.expect):
            wrong.append((b.path, b.kind, b.data, code.name, details))
    print(f"\n{where}: {len(bad)} undecodable requests: {dict(sorted(seen.items()))}")
    return wrong
