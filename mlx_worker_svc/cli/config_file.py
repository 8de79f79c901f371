"""`--config FILE`: the flags of `serve`, `fleet` and `gateway` read from one TOML or YAML file.

The file has a section per command (`[serve]`, `[fleet]`, `[gateway]`) whose
keys are the command's long flags without the dashes (`max-num-seqs = 64`;
`max_num_seqs` is the same key), so one file can describe a whole fleet. A
section may hold named sub-sections (`[serve.mac1]`) for processes of one
command that differ (each worker's port, say): `--config-section mac1` takes
the section's keys, then the sub-section's over them; a section with
sub-sections needs `--config-section`. A value is what the flag takes:
`true`/`false` for a switch (`auto-init = true`), a list for a repeatable
flag or one of several values (`worker = ["a:1", "b:2"]`, `models = ["a=/m/a"]`),
else a string or a number, converted and
checked as the flag's text would be. Flags given on the command line win: a
flag there replaces the file's value (a repeatable one its whole list). An
unknown section or key, or a value the flag refuses, exits with status 2 and a
message naming it. `.toml` files are read with the standard library's
`tomllib`, `.yaml`/`.yml` files with PyYAML (`yaml.safe_load`).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMMANDS = ("serve", "fleet", "gateway")
_SUFFIXES = (".toml", ".yaml", ".yml")
_NOT_KEYS = {"help", "config", "config-section"}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config` and `--config-section` on one of `COMMANDS`."""
    group = parser.add_argument_group("config file (see docs/config.md)")
    group.add_argument(
        "--config",
        metavar="FILE",
        help="read flags from this TOML or YAML file's section for the command; flags "
        "given here win",
    )
    group.add_argument(
        "--config-section",
        metavar="NAME",
        help="the named sub-section of the command's section (e.g. [serve.NAME]) to add",
    )


def apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Sets the defaults of the command in `argv` from its `--config` file, if it names one."""
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--config")
    pre.add_argument("--config-section")
    try:
        given, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:
        return  # `--config` without its value: the command's own parser says so
    commands = _commands(parser)
    name = next((token for token in argv if token in commands), None)
    if name not in COMMANDS:
        return
    command = commands[name]
    if given.config is None:
        if given.config_section is not None:
            command.error("--config-section names a section of a --config FILE: give the file")
        return
    path = Path(given.config)
    flags = {
        option.removeprefix("--"): action
        for action in command._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    notation = _Notation(yaml=path.suffix != ".toml")
    try:
        data = _load(path)
        values, origins = _section(data, name, given.config_section, set(flags), notation)
    except ValueError as exc:
        command.error(f"{path}: {exc}")
    spelled: dict[str, str] = {}
    sources: dict[str, str] = {}  # --flag -> where the file set it (usage_error names it)
    for key, value in values.items():
        flag = _flag_name(key)
        if flag in spelled:  # grace_seconds and grace-seconds: one key
            command.error(f"{path}: '{spelled[flag]}' and '{key}' are the same key; give it once")
        spelled[flag] = key
        action = flags.get(flag)
        if action is None or flag in _NOT_KEYS:
            known = [f for f in flags if f not in _NOT_KEYS]
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            where = notation.section(origins[key])
            command.error(f"{path}: unknown key '{key}' in {where}{hint}")
        try:  # checked even where the command line gives the flag: the file is wrong
            converted = _convert(action, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            command.error(f"{path}: {notation.setting(origins[key], key, value)}: {exc}")
        if _on_command_line(action, argv):
            continue
        command.set_defaults(**{action.dest: converted})
        action.required = False
        sources[f"--{flag}"] = f"{path}: {notation.setting(origins[key], key, value)}"
    command.set_defaults(config_values=sources)


def usage_error(args: argparse.Namespace, message: object) -> int:
    """Prints a problem with flags found once they parsed, `mlx-worker COMMAND: MESSAGE` on
    one line, naming the --config file and key of each flag it names that the file set;
    returns the exit status of a usage error, 2."""
    text = str(message)
    sources: dict[str, str] = getattr(args, "config_values", {})
    named = [sources[f] for f in dict.fromkeys(_FLAG.findall(text)) if f in sources]
    if named:
        text += f" (set in {'; '.join(named)})"
    print(f"mlx-worker {args.command}: {text}", file=sys.stderr, flush=True)
    return 2


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _load(path: Path) -> Any:
    if path.suffix not in _SUFFIXES:
        raise ValueError(f"a config file is {', '.join(_SUFFIXES)}, not {path.suffix or 'bare'}")
    try:
        if path.suffix == ".toml":
            with path.open("rb") as file:
                return tomllib.load(file)
        import yaml

        with path.open(encoding="utf-8") as file:
            return yaml.load(file, Loader=_unique_keys_loader(yaml))  # a SafeLoader
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not TOML ({_one_line(exc)})") from exc
    except Exception as exc:  # yaml.YAMLError, without importing yaml for TOML files
        raise ValueError(f"not YAML ({_one_line(exc)})") from exc


def _unique_keys_loader(yaml: Any) -> Any:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (as TOML does)."""

    class UniqueKeys(yaml.SafeLoader):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _section(
    data: Any, name: str, sub: str | None, flags: set[str], notation: _Notation
) -> tuple[dict[str, Any], dict[str, str]]:
    """The keys for command `name` (with sub-section `sub`), and the section of each.

    A table under a key that is one of the command's `flags` (`port = {a = 1}`) is that
    key's (wrong) value, not a sub-section."""

    def table(key: str, value: Any) -> bool:
        return isinstance(value, dict) and _flag_name(key) not in flags

    if not isinstance(data, dict):
        sections = ", ".join(notation.section(c) for c in COMMANDS[:-1])
        raise ValueError(f"expected sections {sections} and/or {notation.section(COMMANDS[-1])}")
    for section, value in data.items():
        if section not in COMMANDS:
            shown = section if isinstance(section, str) else notation.value(section)
            raise ValueError(f"unknown section '{shown}' (sections: {', '.join(COMMANDS)})")
        if not isinstance(value, dict):
            raise ValueError(f"section '{section}' holds no keys (it is {notation.value(value)})")
    if name not in data:
        raise ValueError(f"no {notation.section(name)} section")
    _check_names(data[name], name, notation)
    keys = {k: v for k, v in data[name].items() if not table(k, v)}
    subs = {k: v for k, v in data[name].items() if table(k, v)}
    if sub is None:
        if subs:
            names = ", ".join(subs)
            # A table under a misspelt key reads as a sub-section: name the key it may be.
            close = [
                (k, m[0]) for k in subs if (m := difflib.get_close_matches(_flag_name(k), flags, 1))
            ]
            hint = "".join(f" ('{k}' is no key: did you mean '{m}'?)" for k, m in close)
            raise ValueError(
                f"{notation.section(name)} has sub-sections ({names}): pick one with "
                f"--config-section{hint}"
            )
        return keys, dict.fromkeys(keys, name)
    if sub not in subs:
        if sub in keys:  # `mac1 = [1]`: a key's value, not a table
            raise ValueError(f"{notation.key(name, sub)} is a key, not a section")
        have = f" (it has: {', '.join(subs)})" if subs else ""
        raise ValueError(f"no {notation.section(f'{name}.{sub}')} section{have}")
    _check_names(subs[sub], f"{name}.{sub}", notation)
    for key, value in subs[sub].items():
        if table(key, value):
            raise ValueError(f"{notation.key(f'{name}.{sub}', key)}: sections do not nest further")
    # The sub-section's key replaces the section's, however either spells it.
    replaced = {_flag_name(key) for key in subs[sub]}
    keys = {k: v for k, v in keys.items() if _flag_name(k) not in replaced}
    origins = dict.fromkeys(keys, name) | dict.fromkeys(subs[sub], f"{name}.{sub}")
    return keys | subs[sub], origins


def _check_names(section: dict[Any, Any], path: str, notation: _Notation) -> None:
    """Refuses a key that is not a name (YAML reads `1:`, `true:` or `null:` as a number,
    a boolean or null): a key is a flag's long name."""
    for key in section:
        if not isinstance(key, str):
            raise ValueError(
                f"{notation.section(path)}: the key {notation.value(key)} is not a flag's "
                "name (a key is a long flag without its dashes, such as max-num-seqs)"
            )


def _flag_name(key: str) -> str:
    """A key as its flag spells it: `max_num_seqs` and `max-num-seqs` are one."""
    return key.replace("_", "-")


def _on_command_line(action: argparse.Action, argv: list[str]) -> bool:
    return any(
        token == option or token.startswith(option + "=")
        for token in argv
        for option in action.option_strings
    )


def _convert(action: argparse.Action, value: Any) -> Any:
    """What the flag would hold, given `value` from the file; raises ValueError."""
    if action.nargs == 0:  # a switch: store_true, store_false, store_const
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return action.const if value else action.default
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, item) for item in items]
    return _scalar(action, value)


def _scalar(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError("expected a string or a number")
    text = value if isinstance(value, str) else str(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except ValueError as exc:  # int()'s own words: "invalid literal for int() ..."
        if "invalid literal for int()" not in str(exc):
            raise
        raise ValueError(f"must be an integer, got {text}") from None
    choices = action.choices
    if choices is not None and converted not in choices:
        if isinstance(choices, range):
            raise ValueError(f"not in [{choices.start}, {choices.stop - 1}]")
        raise ValueError(f"not one of {', '.join(map(str, choices))}")
    return converted


@dataclass(frozen=True)
class _Notation:
    """How a message writes the file's sections, keys and values: as the file does, TOML
    (`[serve.w1] port = 'http'`) or YAML (`serve.w1.port: 'http'`)."""

    yaml: bool

    def section(self, path: str) -> str:
        """A section (`serve`, `serve.w1`) as the file's notation names it."""
        return path if self.yaml else f"[{path}]"

    def key(self, path: str, key: str) -> str:
        """A key of a section."""
        return f"{path}.{_key(key)}" if self.yaml else f"[{path}] {_key(key)}"

    def setting(self, path: str, key: str, value: Any) -> str:
        """A key and its value, as the file would write them."""
        sign = ":" if self.yaml else " ="
        return f"{self.key(path, key)}{sign} {self.value(value)}"

    def value(self, value: Any) -> str:
        """A value in the file's notation (`true`, `null`, a date, a table or mapping)."""
        if isinstance(value, bool):
            return "true" if value else "false"
        if value is None:
            return "null"
        if isinstance(value, list):
            return "[" + ", ".join(self.value(item) for item in value) + "]"
        if isinstance(value, dict):  # an inline table, or a flow mapping
            sign = ":" if self.yaml else " ="
            pairs = (f"{_key(k)}{sign} {self.value(v)}" for k, v in value.items())
            return "{" + ", ".join(pairs) + "}"
        if isinstance(value, str | int | float):
            return repr(value)  # 'text': a literal string in TOML, single-quoted in YAML
        return str(value)  # a TOML or YAML date or time


def _key(key: object) -> str:
    """A key as either notation writes it: bare, else quoted."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else repr(text)
