"""One completion on the fleet, as the OpenAI and the Anthropic routes both run it.

`open_answer` sets a validated request up (the tools given to the chat
template, a forced call's grammar), starts `FleetScheduler.generate` and
awaits the fleet's first message before any header goes out, so a full queue
is a 429 and a prompt past the context a 400, never a broken stream. The
`Answer` then hands out the rest: all of it at once (`collect`) or message by
message for a stream (`messages`). Fleet and worker errors become `ApiError`s
(`api_error`), which each API words in its own shape.

When the client goes away, the generate iterator is closed and the fleet frees
the request on its worker (its KV with it) at the next step: while the first
message is awaited or a whole answer is collected, `until_disconnect` watches
for the disconnect and raises `ClientGone`; during a stream Starlette's
`StreamingResponse` cancels the iterator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.fleet import ContextTooLong, FleetScheduler, OutOfVocabulary, PromptTooLarge
from mlx_worker_svc.gateway.errors import ApiError, from_grpc, raise_as
from mlx_worker_svc.gateway.limits import limit_error
from mlx_worker_svc.gateway.metrics import GatewayMetrics
from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gateway.structured import request_error
from mlx_worker_svc.gateway.tool_calls import ToolCallParser, call_grammar, tool_format
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.status import grpc_code

T = TypeVar("T")
Stream = AsyncGenerator[pb.GenerateResponse, None]
# nginx's code for "the client closed the request": what the metrics record then.
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Answer:
    """A request running on the fleet, its first message received."""

    parsed: ParsedRequest
    first: pb.GenerateResponse
    stream: Stream
    tools: ToolCallParser | None  # set when the answer may hold tool calls

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every message, the first included; the fleet's stream is closed at the end."""
        try:
            async for message in _chain(self.first, self.stream):
                yield message
        finally:
            await self.stream.aclose()

    async def collect(self, request: Request) -> list[pb.GenerateResponse]:
        """Every message; raises ClientGone if the client disconnects first."""
        try:
            return await until_disconnect(request, fleet_call(_rest(self.first, self.stream)))
        except ApiError as exc:
            raise_as(answer_error(self.parsed, exc), exc)
        finally:
            await self.stream.aclose()


async def open_answer(
    fleet: FleetScheduler, request: Request, parsed: ParsedRequest, metrics: GatewayMetrics | None
) -> Answer:
    """Starts `parsed` on the fleet; returns once its first message is in (see the module doc).

    Raises `ApiError` for what the fleet refuses (a forced call's or a
    structured output's spec reworded to name the request's field) and
    `ClientGone` when the client disconnects meanwhile. The time to the first
    message is observed in `metrics.ttft` under the request's route (unless
    `metrics` is None: a request of several choices observes it once, itself).
    """
    start = time.monotonic()
    tools = await fleet_call(_tools(fleet, parsed))
    # OpenAI's rule: the prompt leaves room for max_tokens. Anthropic's: an answer may ask
    # for more than is left, and stops at the end of the context.
    reserve = parsed.kind != "messages"
    stream = cast(Stream, fleet.generate(parsed.generate, reserve_max_tokens=reserve))
    try:
        first = await until_disconnect(request, fleet_call(_first(parsed, stream)))
    except ApiError as exc:
        await stream.aclose()
        raise_as(answer_error(parsed, exc), exc)
    except BaseException:
        await stream.aclose()
        raise
    if metrics is not None:
        metrics.ttft.labels(request.url.path).observe(time.monotonic() - start)
    return Answer(parsed, first, stream, tools)


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying `obj` as JSON (and its `event` name, if any)."""
    data = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "").encode() + b"data: " + data.encode() + b"\n\n"


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    """The server-sent events response of a stream."""
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _tools(fleet: FleetScheduler, parsed: ParsedRequest) -> ToolCallParser | None:
    """Sets up a request whose answer may call tools; its parser, or None."""
    tools = parsed.tools
    if not tools.may_call:
        return None
    fmt = tool_format(await fleet.chat_template(parsed.generate.model))
    if parsed.generate.messages:  # else the prompt's tokens were rendered with the tools
        parsed.generate.tools_json = tools.tools_json()
    if tools.forced:  # calls only: a response format is for a later answer
        parallel = tools.parallel and tools.choice == "required"
        grammar = call_grammar(tools.forced, fmt, parallel=parallel)
        parsed.generate.sampling_params.structured_outputs.lark_grammar = grammar
    elif parsed.answer_schema is not None:  # calls, or an answer of the schema
        answer = parsed.answer_schema
        grammar = call_grammar(tools.tools, fmt, parallel=tools.parallel, answer=answer)
        parsed.generate.sampling_params.structured_outputs.lark_grammar = grammar
    return ToolCallParser(fmt, parallel=tools.parallel)


async def _first(parsed: ParsedRequest, stream: Stream) -> pb.GenerateResponse:
    try:
        return await anext(stream)
    except (ContextTooLong, OutOfVocabulary, PromptTooLarge) as exc:
        raise limit_error(parsed.kind, exc) from exc


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`; cancels it and raises ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _chain(
    first: pb.GenerateResponse, rest: AsyncIterator[pb.GenerateResponse]
) -> AsyncIterator[pb.GenerateResponse]:
    yield first
    if first.finish_reason:
        return
    async for message in rest:
        yield message


async def _rest(
    first: pb.GenerateResponse, stream: AsyncIterator[pb.GenerateResponse]
) -> list[pb.GenerateResponse]:
    return [message async for message in _chain(first, stream)]


async def fleet_call(work: Awaitable[T]) -> T:
    """Awaits a fleet call; its errors become `ApiError`s."""
    try:
        return await work
    except (WorkerError, ClientError) as exc:
        raise api_error(exc) from exc
    except StopAsyncIteration as exc:  # the fleet always ends with a finish reason
        raise ApiError(
            500, "the fleet ended the request without an answer", kind="server_error"
        ) from exc


def answer_error(parsed: ParsedRequest, exc: WorkerError | ClientError | ApiError) -> ApiError:
    """The `ApiError` of a failed answer, first message or later: an error about a field
    the gateway filled (a spec, the tools) reworded to name the request's field."""
    constrained = parsed.tools.forced or parsed.answer_schema is not None
    spec_from = parsed.structured_param or ("tools" if constrained else None)
    # Beside tools the grammar is the gateway's (calls, or the answer's JSON): not shown.
    own = parsed.tools.may_call and bool(constrained)
    anthropic = parsed.kind == "messages"
    return request_error(api_error(exc), spec_from, anthropic=anthropic, own_grammar=own)


def api_error(exc: WorkerError | ClientError | ApiError) -> ApiError:
    """The `ApiError` of a fleet, client or worker error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientError):
        return from_grpc(exc.code, exc.details)
    return from_grpc(grpc_code(exc.code), exc.message)
