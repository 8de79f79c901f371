"""The in-process mlx-lm baselines: stream_generate, BatchGenerator, re-prefill.

All greedy, with no EOS stop, so each produces exactly as many tokens as the
worker does. Every function ends with `mx.synchronize()`: mlx-lm launches the
next step asynchronously, and that stray work must not run into the next
measurement.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step, stream_generate

from benchmarks.timeline import Timeline


def raw_stream(
    model: Any, tokenizer: Any, prompt: list[int], max_tokens: int
) -> tuple[Timeline, list[int]]:
    """`mlx_lm.stream_generate` with the tokenizer's EOS ids cleared for the call."""
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    timeline = Timeline()
    tokens: list[int] = []
    try:
        for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
            timeline.add(1)
            tokens.append(int(response.token))
    finally:
        tokenizer.eos_token_ids = saved
        mx.synchronize()
    return timeline, tokens


def raw_generate_step(model: Any, prompt: list[int], max_tokens: int) -> tuple[Timeline, list[int]]:
    """`mlx_lm.generate.generate_step` (KV cache, no detokenizer, no EOS check)."""
    timeline = Timeline()
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        timeline.add(1)
        tokens.append(int(token))
    mx.synchronize()
    return timeline, tokens


def raw_batch(
    model: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[Timeline, list[list[int]]]:
    """mlx-lm's BatchGenerator: all prompts prefilled as one batch, then decoded together.

    The timeline's stats also carry `generation_tps`, BatchGenerator's own
    statistics (`BatchStats.generation_tps`) over the same run.
    """
    size = len(prompts)
    generator = BatchGenerator(
        model, max_tokens=max_tokens, completion_batch_size=size, prefill_batch_size=size
    )
    timeline = Timeline()
    uids = generator.insert(prompts)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    live = set(uids)
    try:
        with generator.stats() as counted:  # mlx-lm's own view of the same interval
            while live:
                _, responses = generator.next()
                timeline.add(len(responses))
                for response in responses:
                    tokens[response.uid].append(int(response.token))
                    if response.finish_reason is not None:
                        live.discard(response.uid)
        timeline.reported["generation_tps"] = round(counted.generation_tps, 1)
    finally:
        generator.close()
        mx.synchronize()
    return timeline, [tokens[uid] for uid in uids]


def reprefill(model: Any, prompt: list[int], max_tokens: int) -> tuple[Timeline, list[int]]:
    """The seeds' approach: no KV cache; every token is a full forward of the sequence."""
    timeline = Timeline()
    sequence = list(prompt)
    for _ in range(max_tokens):
        logits = model(mx.array(sequence, dtype=mx.uint32)[None])
        token = cast(int, mx.argmax(logits[0, -1]).item())
        sequence.append(token)
        timeline.add(1)
    return timeline, sequence[len(prompt) :]
