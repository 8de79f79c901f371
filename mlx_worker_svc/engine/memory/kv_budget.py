"""The KV budget InitCache sets: `num_blocks` blocks of `block_size` tokens.

Accounting is logical, like vLLM's block manager: a request holding T tokens
of KV uses ceil(T / block_size) blocks. A step that would need more blocks
than the budget has is refused before anything changes. The prefix cache's
blocks are inside the budget too, but evictable, so they never refuse a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlx_worker_svc.core.errors import ResourceExhausted


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def used(self, kv_tokens: Iterable[int]) -> int:
        """Blocks that requests holding `kv_tokens` tokens each take."""
        return sum(self.blocks_for(t) for t in kv_tokens)

    def check(
        self, kv_tokens_after: Iterable[int], what: str, detail: Callable[[], str] = str
    ) -> None:
        """Raises ResourceExhausted if holding `kv_tokens_after` exceeds the budget; the
        message ends with `detail()` (which requests grow), computed only then."""
        needed = self.used(kv_tokens_after)
        if needed > self.num_blocks:
            raise ResourceExhausted(
                f"{what} needs {needed} KV blocks but the budget is {self.num_blocks} "
                f"blocks of {self.block_size} tokens; finish or preempt requests first"
                f"{detail()}"
            )
