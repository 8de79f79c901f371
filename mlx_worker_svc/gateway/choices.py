"""`n` choices of one OpenAI request: n fleet requests, one answer.

As vLLM's parallel sampling does: choice i is a fleet request of its own (the
fleet request id `{id}-{i}`; with a `seed`, seed + i, so the choices differ
and the same request gives the same choices again), and every choice is
opened (its first message in) before any header goes out: a choice the fleet
refuses (a full queue, a prompt past the context) refuses the whole request,
and the choices already opened are freed. A stream interleaves the choices'
chunks as they come, each carrying its `index`; a whole answer lists them in
index order. The usage counts the prompt once and every choice's completion.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

T = TypeVar("T")
_SEEDS = 2**64  # SamplingParams.seed is a uint64


def fan_out(parsed: ParsedRequest) -> list[ParsedRequest]:
    """The requests of `parsed`'s `n` choices (itself when n is 1)."""
    if parsed.n == 1:
        return [parsed]
    children = []
    for index in range(parsed.n):
        generate = pb.GenerateRequest()
        generate.CopyFrom(parsed.generate)
        generate.request_id = f"{parsed.id}-{index}"
        params = generate.sampling_params
        if params.HasField("seed"):
            params.seed = (params.seed + index) % _SEEDS
        children.append(replace(parsed, generate=generate, n=1))
    return children


async def all_or_none(
    work: Sequence[Awaitable[T]], release: Callable[[T], Awaitable[None]] | None = None
) -> list[T]:
    """Awaits every awaitable; when one fails, cancels the others, `release`s the results
    of those that finished meanwhile and raises its error."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        if release is not None:
            for result in done:
                if not isinstance(result, BaseException):
                    await release(result)
        raise


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they come; the first error ends it (the rest cancelled)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((True, item))
        except Exception as exc:
            await queue.put((False, exc))
        else:
            await queue.put((False, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            ok, item = await queue.get()
            if ok:
                yield item
            elif item is None:
                running -= 1
            else:
                raise item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def combine(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One whole answer of every choice's (each built as choice `index`, in order)."""
    if len(bodies) == 1:
        return bodies[0]
    out = dict(bodies[0])
    out["choices"] = [body["choices"][0] for body in bodies]
    out["usage"] = combined_usage([body["usage"] for body in bodies])
    return out


def combined_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompt (and its cached part) once, every choice's completion tokens."""
    out = dict(usages[0])
    out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out
