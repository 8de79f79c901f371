"""A tool's schema as the workers' grammar engine can hold a tool that is not strict to it.

OpenAI's and Anthropic's APIs do not hold a tool that is not `strict` to every
keyword of its schema, and the workers' grammar engine (llguidance) refuses
part of JSON Schema. `relaxed` leaves out, at every level, what it would
refuse: the keywords it does not enforce (min/maxProperties only where every
property is required), an unknown `format`, a `pattern` with look-around or
back-references (no regular language), a `const`, `enum` or bound holding an
integer past 2^53 (the engine reads numbers as doubles), a bound past 64
bits and a `$ref` that
points nowhere in the schema; it takes a `oneOf` as `anyOf` (the engine
refuses branches that may overlap) and writes counts given as integral
floats (`1.0`) as integers. The constraint then allows a superset of what
the schema allows, never less.
"""

from __future__ import annotations

import re
from typing import Any

from mlx_worker_svc.core.structured_outputs import big_integer

_UNENFORCED = frozenset(
    {
        "uniqueItems", "not", "contains", "minContains", "maxContains", "propertyNames",
        "dependentRequired", "dependentSchemas", "dependencies", "if", "then", "else",
        "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties",
        "$dynamicAnchor", "$dynamicRef",
    }
)  # fmt: skip
_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_INT64 = 2**63 - 1  # a bound past it the engine refuses
# Look-around ((?=, (?!, (?<=, (?<!) and back-references (\1, \k<name>).
_NOT_REGULAR = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")


def relaxed(schema: Any, root: Any = None) -> Any:
    """`schema` without what the grammar engine would refuse (see the module doc)."""
    root = schema if root is None else root
    if isinstance(schema, list):  # draft 7's tuple `items`
        return [relaxed(sub, root) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    one_of: list[Any] | None = None
    for key, given in schema.items():
        value = int(given) if key in _COUNTS and _integral(given) else given
        if key in _UNENFORCED or (key == "format" and value not in _FORMATS):
            continue
        if key == "pattern" and isinstance(value, str) and _NOT_REGULAR.search(value):
            continue
        if key in (*_BOUNDS, "const", "enum") and big_integer(value) is not None:
            continue
        if key in _BOUNDS and isinstance(value, float) and abs(value) > _INT64:
            continue
        if key == "$ref" and not _points_into(value, root):
            continue
        if key == "oneOf" and isinstance(value, list):
            one_of = [relaxed(sub, root) for sub in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: relaxed(sub, root) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [relaxed(sub, root) for sub in value]
        else:
            out[key] = relaxed(value, root) if key in _SCHEMA_ONE else value
    if one_of is not None:  # anyOf allows what oneOf does, and more
        if "anyOf" in out:
            out["allOf"] = [*out.get("allOf", []), {"anyOf": one_of}]
        else:
            out["anyOf"] = one_of
    return out


def _integral(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer()


def _points_into(ref: Any, root: Any) -> bool:
    """Whether `ref` is a JSON pointer into `root` (`#`, `#/$defs/a`) that finds a schema,
    or an anchor (`#name`), left to the engine; a remote one is not."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return False
    if ref != "#" and not ref.startswith("#/"):
        return True
    node = root
    for escaped in ref[2:].split("/") if ref != "#" else ():
        part = escaped.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return isinstance(node, dict | bool)
