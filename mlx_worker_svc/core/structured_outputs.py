"""What a request's output must match: a schema, a regex, choices or a grammar.

A `StructuredOutputs` is hashable, so the engine caches compiled grammars by it;
`validate` names the offending field of the request it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_worker_svc.core.errors import InvalidArgument

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark_grammar", "gbnf_grammar")
_JSON_KINDS = ("json_schema", "json_object")


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
