"""Anthropic's `/v1/messages` and `/v1/messages/count_tokens` over the fleet.

A message is one completion run as the OpenAI routes run theirs
(calls.py: the first fleet message awaited before any header, disconnects
cancelling it, tools and forced calls set up the same way). The gateway
renders the prompt itself (`prompt_tokens`: the chat template through a
worker's Tokenize, with the tools, then a prefill's text after it) and hands
the fleet its token ids, so a stream's `message_start` carries the prompt's
size and count_tokens counts exactly what a message would compute. A stream
is Anthropic's event sequence (reply.py); an error after the headers went
out is an `error` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.fleet import FleetScheduler, PromptTooLarge
from mlx_worker_svc.fleet.errors import ShuttingDown
from mlx_worker_svc.gateway import request_ids
from mlx_worker_svc.gateway.anthropic.reply import Blocks, MessageReply, Sse
from mlx_worker_svc.gateway.anthropic.schema import MessagesRequest, parse_messages
from mlx_worker_svc.gateway.body import parse_body
from mlx_worker_svc.gateway.calls import (
    CLIENT_CLOSED,
    Answer,
    ClientGone,
    answer_error,
    api_error,
    event_stream,
    fleet_call,
    open_answer,
    sse,
    until_disconnect,
)
from mlx_worker_svc.gateway.errors import ApiError, raise_as
from mlx_worker_svc.gateway.limits import limit_error
from mlx_worker_svc.gateway.metrics import GatewayMetrics
from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gateway.structured import request_error
from mlx_worker_svc.gateway.tool_calls import Event
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


async def prompt_tokens(fleet: FleetScheduler, request: MessagesRequest) -> list[int]:
    """The prompt's token ids: the chat (and the tools it may call), then the prefill."""
    parsed = request.parsed
    tools = parsed.tools.tools_json() if parsed.tools.may_call else ""
    ask = pb.TokenizeRequest(messages=parsed.generate.messages, tools_json=tools)
    model = parsed.generate.model
    try:
        rendered = await fleet_call(fleet.tokenize(ask, model))
        if not request.prefill:
            return list(rendered.token_ids)
        whole = pb.TokenizeRequest(text=rendered.text + request.prefill)
        return list((await fleet_call(fleet.tokenize(whole, model))).token_ids)
    except ApiError as exc:
        if isinstance(exc.__cause__, PromptTooLarge):  # what agents compact the chat on
            raise limit_error("messages", exc.__cause__) from exc
        # names `tools` (or `messages`)
        raise_as(request_error(exc, None, anthropic=True), exc)


class MessagesApi:
    """The Anthropic routes' handlers, over the gateway's fleet and metrics."""

    def __init__(
        self,
        fleet: FleetScheduler,
        metrics: GatewayMetrics,
        model_for: Callable[[ParsedRequest], Awaitable[str]],
        count: Callable[[pb.GenerateResponse], None],
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        # Resolves a request's model and routes it there (404 if unknown); its id.
        self.model_for = model_for
        self.count = count  # counts a finished answer's tokens

    async def count_tokens(self, request: Request) -> Response:
        if self.fleet.draining:  # a new request, as a message is (it takes no queue place)
            raise api_error(ShuttingDown())
        body = parse_body(await request.body())
        messages = parse_messages(body, request_ids.base(request), count=True)
        await self.model_for(messages.parsed)
        return JSONResponse({"input_tokens": len(await prompt_tokens(self.fleet, messages))})

    async def create(self, request: Request) -> Response:
        route = request.url.path
        messages = parse_messages(parse_body(await request.body()), request_ids.base(request))
        parsed = messages.parsed
        request_ids.answered(request, parsed.id)
        model = await self.model_for(parsed)
        try:
            prompt = await until_disconnect(request, self._prompt(messages))
        except ClientGone:  # it left while it waited: its place in the queue is free
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)
        parsed.generate.ClearField("messages")
        parsed.generate.prompt_token_ids.extend(prompt)
        reply = MessageReply(parsed, model, len(prompt))
        try:
            answer = await open_answer(self.fleet, request, parsed, self.metrics)
            reply.cached_tokens = answer.first.num_cached_prompt_tokens
            blocks = Blocks(text_first=answer.tools is None)
            if parsed.stream:
                return event_stream(self._events(reply, blocks, answer, route))
            done = await answer.collect(request)
        except ClientGone:
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)
        text = "".join(m.text for m in done)
        blocks.feed(_pieces(answer, text, finished=True))
        blocks.finish()
        self.count(done[-1])
        return JSONResponse(reply.message(blocks, done[-1]))

    async def _prompt(self, messages: MessagesRequest) -> list[int]:
        """The prompt's ids, tokenized here (the prefill and the usage's input_tokens need
        them first): meanwhile it waits in the fleet's queue, as a chat routed whole does."""
        try:
            generate = messages.parsed.generate
            async with self.fleet.queue_slot(generate.model, generate.request_id):
                return await prompt_tokens(self.fleet, messages)  # raises ApiErrors
        except (WorkerError, ClientError) as exc:  # the queue full, or the fleet draining
            raise api_error(exc) from exc

    async def _events(
        self, reply: MessageReply, blocks: Blocks, answer: Answer, route: str
    ) -> AsyncIterator[bytes]:
        last = answer.first
        try:
            yield _send(reply.start(blocks))
            async for message in answer.messages():
                last = message
                pieces = _pieces(answer, message.text, finished=bool(message.finish_reason))
                events = blocks.feed(pieces)
                if events:
                    yield _send(events)
        except (WorkerError, ClientError, ApiError) as exc:
            # The headers are out: the error travels as an event, as Anthropic sends it.
            yield sse(answer_error(answer.parsed, exc).anthropic_body(), "error")
            return
        except asyncio.CancelledError:  # the client went away mid-stream
            self.metrics.disconnects.labels(route).inc()
            raise
        finally:
            await answer.stream.aclose()  # the fleet frees the request now, whatever ended it
        self.count(last)
        yield _send(reply.end(blocks, last))


def _pieces(answer: Answer, text: str, *, finished: bool) -> list[Event]:
    """The text and calls of `text`, the next of the answer (everything at the end if finished)."""
    if answer.tools is None:
        return [text]
    found = answer.tools.feed(text)
    return found + answer.tools.finish() if finished else found


def _send(events: list[Sse]) -> bytes:
    return b"".join(sse(data, name) for name, data in events)
