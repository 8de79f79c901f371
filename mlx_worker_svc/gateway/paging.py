"""`GET /v1/models` paging, as Anthropic's API has it: `limit`, `after_id`, `before_id`.

OpenAI's list has no paging: without any of these parameters the page is
every model (has_more false), which OpenAI clients read whole. With them, the
page is at most `limit` ids (1 to 1,000; 20 when only an id is given) after
`after_id` or before `before_id` (not both), and `has_more` says whether ids
lie beyond it in the direction asked, as the Anthropic SDK's iteration reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlx_worker_svc.gateway.errors import invalid

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


@dataclass(frozen=True)
class Page:
    ids: list[str]
    has_more: bool


def page(ids: Sequence[str], query: Mapping[str, str]) -> Page:
    """The page of `ids` the query asks for; a bad parameter is a 400 naming it."""
    after, before, raw = query.get("after_id"), query.get("before_id"), query.get("limit")
    if after is None and before is None and raw is None:
        return Page(list(ids), False)
    if after is not None and before is not None:
        raise invalid("before_id", "give after_id or before_id, not both")
    limit = DEFAULT_LIMIT
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
            raise invalid("limit", f"expected an integer from 1 to {MAX_LIMIT}, got {raw!r}")
        limit = int(raw)
    if before is not None:
        end = _place(ids, before, "before_id")
        return Page(list(ids[max(end - limit, 0) : end]), end - limit > 0)
    start = _place(ids, after, "after_id") + 1 if after is not None else 0
    return Page(list(ids[start : start + limit]), start + limit < len(ids))


def _place(ids: Sequence[str], wanted: str, param: str) -> int:
    if wanted not in ids:
        raise invalid(param, f"no model {wanted!r} in the list")
    return ids.index(wanted)
