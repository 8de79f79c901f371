"""Anthropic's `thinking` option and thinking blocks, as this gateway takes them.

Agents send `thinking` on every request (Claude Code sends
`{"type": "adaptive"}` by default): it allows the model to think before it
answers, up to `budget_tokens`, and never requires it. The served models'
reasoning is not parsed into thinking blocks, so an answer has none, which
the option allows; its shape is checked as Anthropic's API checks it.
Thinking blocks an assistant turn carries back (from an answer elsewhere)
are left out of the prompt, as Anthropic's API leaves earlier turns'
thinking out of the context. So `context_management`'s
`clear_thinking_20251015` edit (which Claude Code sends beside adaptive
thinking) changes nothing here, and is taken; the edits that would rewrite
the prompt (clearing tool results, compaction) are not done here, and are
a 400 that says so.
"""

from __future__ import annotations

from typing import Any

from mlx_worker_svc.gateway.body import only_keys
from mlx_worker_svc.gateway.errors import invalid

THINKING_BLOCK_KEYS = {
    "thinking": ("type", "thinking", "signature"),
    "redacted_thinking": ("type", "data"),
}
EXTRA = "Extra inputs are not permitted"
MIN_BUDGET = 1024  # Anthropic's least budget_tokens for "enabled"


def check_thinking(value: Any, max_tokens: int | None) -> None:
    """Refuses a `thinking` Anthropic's API refuses (`max_tokens` None: count_tokens)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "adaptive", "disabled"):
        raise invalid(
            "thinking", "expected an object with 'type' 'enabled', 'adaptive' or 'disabled'"
        )
    kind = value["type"]
    if kind == "disabled":
        only_keys(value, ("type",), "thinking", EXTRA)
        return
    only_keys(value, ("type", "budget_tokens", "display"), "thinking", EXTRA)
    if value.get("display") not in (None, "summarized", "omitted"):
        raise invalid("thinking.display", "expected 'summarized' or 'omitted'")
    budget = value.get("budget_tokens")
    if kind == "adaptive" and budget is None:
        return
    if budget is None:
        raise invalid("thinking.budget_tokens", "Field required (an integer)")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise invalid("thinking.budget_tokens", "expected an integer")
    least = MIN_BUDGET if kind == "enabled" else 0
    if budget < least:
        raise invalid("thinking.budget_tokens", f"Input should be greater than or equal to {least}")
    if kind == "enabled" and max_tokens is not None and budget >= max_tokens:
        raise invalid(
            "thinking.budget_tokens", "max_tokens must be greater than thinking.budget_tokens"
        )


def is_thinking(block: Any, where: str) -> bool:
    """Whether `block` is a thinking block (its keys checked), left out of the prompt."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in THINKING_BLOCK_KEYS:
        return False
    only_keys(block, THINKING_BLOCK_KEYS[kind], where, EXTRA)
    return True


CLEAR_THINKING = "clear_thinking_20251015"


def check_context_management(value: Any, thinking: Any) -> None:
    """Takes `context_management` whose edits are all `clear_thinking_20251015`
    (checked as Anthropic's API checks it); refuses the others, naming them."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("context_management", "expected an object with 'edits'")
    only_keys(value, ("edits",), "context_management", EXTRA)
    edits = value.get("edits")
    if edits is None:
        return
    if not isinstance(edits, list):
        raise invalid("context_management.edits", "expected an array of edits")
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise invalid(
                where,
                f"the {kind!r} edit is not supported by this server (only "
                f"{CLEAR_THINKING!r}, which changes nothing here: thinking blocks never "
                "reach the prompt)",
            )
        only_keys(edit, ("type", "keep"), where, EXTRA)
        _check_keep(edit.get("keep"), f"{where}.keep")
        mode = thinking.get("type") if isinstance(thinking, dict) else None
        if mode not in ("enabled", "adaptive"):
            raise invalid(
                where, f"`{CLEAR_THINKING}` strategy requires `thinking` to be enabled or adaptive"
            )


def _check_keep(keep: Any, where: str) -> None:
    if keep is None or keep in ("all", {"type": "all"}):
        return
    if isinstance(keep, dict) and keep.get("type") == "thinking_turns":
        only_keys(keep, ("type", "value"), where, EXTRA)
        value = keep.get("value")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return
    raise invalid(
        where, "expected 'all', {'type': 'all'} or {'type': 'thinking_turns', 'value': N >= 1}"
    )
