"""What a request's output must match: a schema, a regex, choices or a grammar.

A `StructuredOutputs` is hashable, so the engine caches compiled grammars by it;
`validate` names the offending field of the request it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_worker_svc.core.errors import InvalidArgument

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark_grammar", "gbnf_grammar")
_JSON_KINDS = ("json_schema", "json_object")
DOUBLE_EXACT = 2**53
"""Integers past it are rounded by a double, which is how the grammar engine reads
JSON numbers: a schema's const, enum and bounds must stay within it."""


_EXACT = ("const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def inexact_number(schema: Any, path: str = "") -> tuple[str, int | float] | None:
    """(the keyword's path, the integer) of the first integer past DOUBLE_EXACT in a
    keyword the output is held to (const, enum, a bound) of a JSON Schema, if any."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            big = big_integer(value) if key in _EXACT else None
            if big is not None:
                return f"{path}{key}", big
            found = inexact_number(value, f"{path}{key}.")
            if found is not None:
                return found
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found = inexact_number(value, f"{path.rstrip('.')}[{i}].")
            if found is not None:
                return found
    return None


def inexact_number_message(path: str, value: float) -> str:
    """Why a schema with `value` at `path` (inexact_number's answer) is refused."""
    return (
        f"{path} holds {value}, past 2^53: the grammar engine reads JSON numbers as "
        "doubles and would round it (give it as a string, or a bound within 2^53)"
    )


def big_integer(value: Any) -> int | float | None:
    """An integer in `value` (a JSON value, nested too) past DOUBLE_EXACT, if any; a
    number written with a fraction or exponent counts from DOUBLE_EXACT on, as the
    parser has rounded it already (9007199254740993.0 reads as 2^53)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) > DOUBLE_EXACT else None
    if isinstance(value, float):
        return value if abs(value) >= DOUBLE_EXACT else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for item in items:
        found = big_integer(item)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must be (proto StructuredOutputs); hashable, a cache key.

    `kind` is one of STRUCTURED_KINDS; `text` holds the schema, regex or
    grammar (empty for json_object), `choices` the strings of a choice.
    """

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()
    disable_any_whitespace: bool = False

    def validate(self, where: str) -> None:
        """Raises InvalidArgument naming `where.<field>` for a spec that cannot be compiled."""
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidArgument(f"{where}: set one of {', '.join(STRUCTURED_KINDS)}")
        if self.kind == "choice":
            if not self.choices:
                raise InvalidArgument(f"{where}.choice.choices is empty; give at least one")
            for i, choice in enumerate(self.choices):
                if not choice:
                    raise InvalidArgument(f"{where}.choice.choices[{i}] is empty")
        elif self.kind != "json_object" and not self.text:
            raise InvalidArgument(f"{where}.{self.kind} is empty")
        if self.disable_any_whitespace and self.kind not in _JSON_KINDS:
            raise InvalidArgument(
                f"{where}.disable_any_whitespace applies to json_schema and json_object only, "
                f"not {self.kind}"
            )
