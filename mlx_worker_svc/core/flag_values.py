"""The types of command-line values: ports, counts, seconds and fractions, checked at parse.

Each is an argparse `type`: a value out of its range is argparse's one-line
usage error and exit status 2, naming the flag, before anything starts (a
port of 70000 would otherwise wrap to 4464 in the socket layer, a count of 0
stall every request, a negative time abort a drain at once).
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
from collections.abc import Callable

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0 to 65535, got {value}")
    return value


def count(minimum: int) -> Callable[[str], int]:
    """An integer of at least `minimum`."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def host(text: str) -> str:
    """An address to bind: not empty (gRPC and HTTP servers need one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must not be empty (127.0.0.1: this machine only; 0.0.0.0 or ::: every interface)"
        )
    return text


def context_cap(text: str) -> int:
    """A context length cap: 0 (none) or at least 2 (a prompt is shorter than the context)."""
    value = _int(text)
    if value < 0 or value == 1:
        raise argparse.ArgumentTypeError(
            f"must be 0 (the model's context) or >= 2 (a prompt is shorter than the "
            f"context), got {value}"
        )
    return value


def within(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high`."""

    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


# The longest time a flag takes (about 11.5 days): gRPC deadlines past ~10^10 s overflow
# into ones already expired.
MAX_SECONDS = 1_000_000


def seconds(*, zero: bool) -> Callable[[str], float]:
    """A number of seconds above 0 (or, with `zero`, at least 0), at most MAX_SECONDS."""

    def parse(text: str) -> float:
        value = _float(text)
        if not (0 <= value <= MAX_SECONDS) or (value == 0 and not zero):  # NaN fails too
            bound = ">= 0" if zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds {bound} and at most {MAX_SECONDS}, got {text}"
            )
        return value

    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def log_level(text: str) -> str:
    """A level name `logging` knows (LOG_LEVELS, and its aliases WARN and FATAL), any case."""
    level = text.upper()
    if level == "NOTSET" or not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def target(text: str) -> str:
    """A gRPC server's HOST:PORT (a port 0 to 65535; an IPv6 host in brackets)."""
    host, sep, number = text.rpartition(":")
    if not (sep and host and number.isdigit()):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: an IPv6 address goes in brackets, as in [{host}]:{number}"
        )
    port(number)
    return text


def bind_address(host: str, port: int) -> str:
    """HOST:PORT for a gRPC server to bind, an IPv6 literal ("::1") put in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT; an OSError names --host and --port and the cause (a
    port in use: "Address already in use"). The gRPC servers bind one and close it before
    gRPC binds: gRPC's own failure is a C-core log line and a message without the cause."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(f"--host {host!r}: cannot listen there ({exc.strerror or exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        raise OSError(f"--host {host} --port {port}: cannot listen there ({why})") from exc
    return sock
