"""Token timelines: when each batch of tokens arrived, and what that means.

Every path (Generate, Execute, mlx-lm) is reduced to the same shape: a start
time and a list of (arrival time, tokens that arrived) events. Time to first
token is the first event with tokens; the decode phase runs from that event to
the last one, so prefill is excluded from decode tokens/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timeline:
    start_ns: int = field(default_factory=time.perf_counter_ns)
    events: list[tuple[int, int]] = field(default_factory=list)
    # What the generator measured itself (mlx-lm's BatchStats), beside the timeline's figures.
    reported: dict[str, float] = field(default_factory=dict)

    def add(self, count: int) -> None:
        self.events.append((time.perf_counter_ns(), count))

    @property
    def total_tokens(self) -> int:
        return sum(n for _, n in self.events)

    def stats(self) -> dict[str, Any]:
        """TTFT, decode tokens/s (after the first token) and end-to-end tokens/s."""
        return {**combined_stats([self]), **self.reported}


def combined_stats(timelines: list[Timeline]) -> dict[str, Any]:
    """`Timeline.stats` over requests that each have a timeline of their own.

    Decode counts the tokens after each request's first, over the time from the
    earliest first token to the last token of all; time to first token is when
    the last request got its first (every request prefilled, as when a batch's
    first tokens arrive together); `ttft_first_s` is the earliest. One timeline
    (a whole batch stepped together) is the plain case.
    """
    firsts: list[tuple[int, int]] = []
    last_t, decode_tokens = 0, 0
    for timeline in timelines:
        hits = [(t, n) for t, n in timeline.events if n > 0]
        if hits:
            firsts.append(hits[0])
            decode_tokens += sum(n for _, n in hits[1:])
            last_t = max(last_t, hits[-1][0])
    if not firsts:
        return {"tokens": 0}
    start = min(t.start_ns for t in timelines)
    first_t = min(t for t, _ in firsts)
    first_n = sum(n for _, n in firsts)
    decode_s = (last_t - first_t) / 1e9
    total_s = (last_t - start) / 1e9
    stats: dict[str, Any] = {
        "tokens": first_n + decode_tokens,
        "ttft_s": round((max(t for t, _ in firsts) - start) / 1e9, 4),
        "decode_tokens": decode_tokens,
        "decode_s": round(decode_s, 4),
        "decode_tok_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "total_s": round(total_s, 4),
        "e2e_tok_s": round((first_n + decode_tokens) / total_s, 3) if total_s > 0 else None,
    }
    if len(timelines) > 1:
        stats["ttft_first_s"] = round((first_t - start) / 1e9, 4)
    return stats
