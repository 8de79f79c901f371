"""Log lines as text or JSON, with the structured fields a record carries.

Code that logs about a request passes its fields through the standard
`extra=` (`req_id`, `rpc`, `code`, `finish_reason`, token counts, `worker`).
`TextFormatter` appends them to the usual line as `key=value` pairs;
`JsonFormatter` writes one JSON object a line: `ts` (UTC, ISO 8601), `level`,
`logger`, `message`, then the fields, and `exc` for a traceback.
`configure_logging` installs one of them on the root logger for the
`--log-level` / `--log-format` flags every command takes.
"""

from __future__ import annotations

import argparse
import json
import logging
from datetime import UTC, datetime
from typing import Any

from mlx_worker_svc.core.flag_values import LOG_LEVELS, log_level

LOG_FORMATS = ("text", "json")
# What log lines and error messages quote of a client's string (a request id,
# a path): enough to recognise it, never a megabyte of it.
CLIP_CHARS = 200
# Any field of a log line, whatever put it there, is cut at this length.
_FIELD_CHARS = 2000

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",  # uvicorn's copy of its message with terminal colour codes
}


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text`, or its first `limit` characters and its length when it is longer.

    For every client string that a log line or an error message quotes.
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text)} chars]"


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The `extra=` fields of a record, in the order they were given (long strings clipped)."""
    return {
        k: clip(v, _FIELD_CHARS) if isinstance(v, str) else v
        for k, v in vars(record).items()
        if k not in _STANDARD and not k.startswith("_")
    }


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        fields = record_fields(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if not text or " " in text else text


def add_logging_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """`--log-level` and `--log-format`; a subcommand's copies keep the top level's defaults."""
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="INFO" if defaults else argparse.SUPPRESS,
        help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if defaults else argparse.SUPPRESS,
        help="text lines, or one JSON object a line (default text)",
    )


def configure_logging(level: str, fmt: str) -> None:
    """Sends log records to stderr, formatted as `fmt` ('text' or 'json')."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
