"""A request body as JSON (`parse_body`) and typed reads of its fields (`Fields`).

Both APIs' schemas read their bodies through these: every failure is a 400
`ApiError` naming the field (`invalid`), in the API's own error shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

from mlx_worker_svc.gateway.errors import ApiError, invalid


class Fields:
    """Typed reads of a JSON object's fields; every failure names the field."""

    def __init__(self, body: dict[str, Any], where: str = "") -> None:
        self.body = body
        self.where = where  # the path of a nested object, as errors name it

    def _param(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(self._param(name), f"expected a boolean, got {json_type(value)}")
        return value

    def number(self, name: str, low: float, high: float) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(self._param(name), f"expected a number, got {json_type(value)}")
        if not (math.isfinite(value) and low <= value <= high):
            raise invalid(self._param(name), f"{value} is not in [{low:g}, {high:g}]")
        return float(value)

    def integer(self, name: str, low: int, high: int) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(self._param(name), f"expected an integer, got {json_type(value)}")
        if not low <= value <= high:
            raise invalid(self._param(name), f"{value} is not in [{low}, {high}]")
        return value


def only_keys(value: dict[str, Any], known: Collection[str], where: str, why: str = "") -> None:
    """Refuses a key of the object at `where` that `known` does not list, naming it: a
    misspelled field is an error, never a field silently ignored. A null one is taken as
    absent (as every optional field may be null): the SDKs dump the optional fields of
    the answers they hand back, such as anthropic's `caller: null`, as nulls."""
    for key, item in value.items():
        if key not in known and item is not None:
            raise invalid(
                f"{where}.{key}", why or f"unknown field ({where} takes {', '.join(known)})"
            )


def check_description(spec: dict[str, Any], where: str) -> None:
    """A tool's or schema's `description`, when given, is a string (it reaches the
    prompt as text)."""
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description", f"expected a string, got {json_type(description)}")


def json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names |= {list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_body(raw: bytes) -> Any:
    """The request body's JSON value; raises `ApiError` (400) for anything else.

    JSON between systems is UTF-8 (RFC 8259), so other encodings are refused,
    and so is a string with a lone surrogate escape ("\\ud800"), which is no
    Unicode character and could reach neither the fleet nor an error message.
    """
    cannot = "We could not parse the JSON body of your request"
    try:
        body = json.loads(
            raw.decode("utf-8"),
            parse_constant=_no_constant,
            parse_int=_integer,
            object_pairs_hook=_unique_keys,
        )
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"{cannot}: it is not UTF-8 text ({exc})") from exc
    except ValueError as exc:
        raise ApiError(400, f"{cannot}: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, f"{cannot}: it nests too deeply") from exc
    long = _too_long(body)
    if long is not None:
        where, why = long
        raise invalid(where, why) if where else ApiError(400, f"{cannot}: {why}")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        why = "a string holds a lone surrogate escape (\\ud800 to \\udfff without its pair)"
        raise ApiError(400, f"{cannot}: {why}") from exc
    return body


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object of the body, whose keys must differ: JSON leaves a repeated key's meaning
    open and Python keeps the last, so `{"max_tokens": 2, "max_tokens": 3}` or a token
    twice in `logit_bias` would drop a value the client sent without a word."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"the key {json.dumps(key)} appears twice in one object")
        obj[key] = value
    return obj


class _TooLong:
    """A JSON integer longer than Python converts (4,300 digits): refused by its path."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))


def _integer(digits: str) -> int | _TooLong:
    try:
        return int(digits)
    except ValueError:
        return _TooLong(digits)


def _too_long(value: Any) -> tuple[str, str] | None:
    """The path (`a.b[0].c`) of the first integer too long to read in `value`, and why it
    is refused; None when there is none. (Iterative: a body may nest as deep as the JSON
    reader allows.)"""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, _TooLong):
            return path, f"an integer of {item.digits} digits, more than this server reads (4300)"
        if isinstance(item, dict):
            todo += reversed([(f"{path}.{k}" if path else str(k), v) for k, v in item.items()])
        elif isinstance(item, list):
            todo += reversed([(f"{path}[{i}]", v) for i, v in enumerate(item)])
    return None


def json_text(text: str, param: str) -> Any:
    """The JSON value of a field that holds JSON text (a schema given as a string);
    raises `invalid(param, ...)` when it is not JSON, as the body's own reading does."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_integer)
    except (ValueError, RecursionError) as exc:
        raise invalid(param, f"not JSON ({exc})") from exc
    long = _too_long(value)
    if long is not None:
        where, why = long
        raise invalid(f"{param}.{where}" if where else param, why)
    return value


def _no_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity, which RFC 8259 has no place for.
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)")
