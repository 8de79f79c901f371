"""The OpenAI-compatible HTTP API over an in-process `FleetScheduler` (a Starlette app).

Routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions` (both with
and without server-sent events), `/health` and `/metrics`. A completion is one
`FleetScheduler.generate` call: the request is validated first
(`schema.parse_request`) and its model resolved (`Gateway.resolve_model`: every
model of the fleet is served by its name, an unknown one is a 404), the fleet's
first message is awaited before any header goes out (so a full queue is a 429
and a prompt past the context a 400, never a broken stream), and from then on
every fleet message becomes a chunk.

When the client goes away, the generate iterator is cancelled, and the fleet
frees the request on its worker (its KV with it) at the next step: while the
first message is awaited or a whole answer is collected this app watches for
the disconnect itself; during a stream Starlette's `StreamingResponse` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.fleet import ContextTooLong, FleetScheduler, OutOfVocabulary
from mlx_worker_svc.gateway.auth import ApiKeyMiddleware
from mlx_worker_svc.gateway.errors import ApiError, from_grpc, invalid
from mlx_worker_svc.gateway.limits import limit_error
from mlx_worker_svc.gateway.metrics import CONTENT_TYPE, GatewayMetrics, MetricsMiddleware
from mlx_worker_svc.gateway.responses import Reply, TokenTexts, shown_logprobs, token_ids
from mlx_worker_svc.gateway.schema import Kind, ParsedRequest, parse_body, parse_request
from mlx_worker_svc.gateway.structured import request_error
from mlx_worker_svc.gateway.tool_calls import ToolCallParser, call_grammar, tool_format
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import SecurityConfig, token_check
from mlx_worker_svc.rpc.status import grpc_code

T = TypeVar("T")
Stream = AsyncGenerator[pb.GenerateResponse, None]
HEALTH_PATH = "/health"
# nginx's code for "the client closed the request": what the metrics record then.
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class GatewayConfig:
    """What the app serves: the model name it answers to and the API keys (`security.tokens`)."""

    served_model_name: str | None = None
    """The model id of a one-model fleet; default: the fleet's names for its models."""
    security: SecurityConfig = field(default_factory=SecurityConfig)


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + _dumps(obj) + b"\n\n"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Gateway:
    """The routes' state: the fleet, the metrics and the token-text cache."""

    def __init__(self, fleet: FleetScheduler, config: GatewayConfig) -> None:
        self.fleet = fleet
        self.config = config
        self.metrics = GatewayMetrics()
        self._texts_by_model: dict[str, TokenTexts] = {}
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.fleet.start()
        try:
            yield
        finally:
            await self.fleet.stop()

    # ----------------------------------------------------------- models
    def model_names(self) -> list[str]:
        """The served models: the configured name, or the fleet's (`FleetScheduler.models`)."""
        if self.config.served_model_name:
            return [self.config.served_model_name]
        return self.fleet.models()

    def resolve_model(self, asked: str | None) -> tuple[str, str]:
        """(the id answers carry, the fleet's GenerateRequest.model) for a request's `model`.

        Unknown: 404; unset while the fleet serves several: 400. With no worker
        up yet (and nothing configured) the name cannot be checked: the fleet
        waits for a worker and answers NOT_FOUND (404) itself.
        """
        names = self.model_names()
        alias = self.config.served_model_name
        if asked is None:
            if len(names) > 1:
                raise invalid("model", f"the gateway serves {len(names)} models: {names}")
            return (names[0] if names else "unknown"), ""
        if names and asked not in names:
            raise _no_such_model(asked)
        return asked, "" if alias else asked

    def texts(self, model: str) -> TokenTexts:
        """The token-text cache of one model (GenerateRequest.model)."""
        if model not in self._texts_by_model:
            self._texts_by_model[model] = TokenTexts(partial(self.fleet.detokenize, model=model))
        return self._texts_by_model[model]

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlx-worker"}

    async def list_models(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": [self._model_card(n) for n in self.model_names()]}
        )

    async def get_model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name not in self.model_names():
            raise _no_such_model(name)
        return JSONResponse(self._model_card(name))

    def _model_for(self, parsed: ParsedRequest) -> str:
        """Resolves the request's model and routes its GenerateRequest to it."""
        shown, parsed.generate.model = self.resolve_model(parsed.model)
        return shown

    # -------------------------------------------------- health, metrics
    async def health(self, request: Request) -> JSONResponse:
        status = self.fleet.status()
        up = sum(w.up for w in status.workers)
        body = {
            "status": "ok" if up else "unavailable",
            "workers_up": up,
            "workers": len(status.workers),
            "queued": status.num_queued,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    async def prometheus(self, request: Request) -> Response:
        # The fleet's collectors read its state on this loop, so they run in a thread.
        fleet = await asyncio.to_thread(generate_latest, self.fleet.metrics.registry)
        return Response(self.metrics.render() + fleet, media_type=CONTENT_TYPE)

    # ------------------------------------------------------ completions
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        start = time.monotonic()
        route = request.url.path
        parsed = parse_request(kind, parse_body(await request.body()))
        model = self._model_for(parsed)
        reply = Reply(parsed, model, await _fleet_call(self._tools(parsed)))
        stream = cast(Stream, self.fleet.generate(parsed.generate, reserve_max_tokens=True))
        try:
            first = await self._until_disconnect(request, _fleet_call(self._first(parsed, stream)))
        except ClientGone:
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)
        except ApiError as exc:
            await stream.aclose()
            spec_from = parsed.structured_param or ("tools" if parsed.tools.forced else None)
            raise request_error(exc, spec_from) from exc
        except BaseException:
            await stream.aclose()
            raise
        self.metrics.ttft.labels(route).observe(time.monotonic() - start)
        reply.cached_tokens = first.num_cached_prompt_tokens
        if parsed.stream:
            return StreamingResponse(
                self._events(reply, first, stream, route),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            messages = await self._until_disconnect(request, _fleet_call(_rest(first, stream)))
        except ClientGone:
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)
        finally:
            await stream.aclose()
        texts = await self._texts(parsed, messages)
        self._count(messages[-1])
        return JSONResponse(reply.complete(messages, texts))

    async def _tools(self, parsed: ParsedRequest) -> ToolCallParser | None:
        """Sets up a request whose answer may call tools; its parser, or None."""
        tools = parsed.tools
        if not tools.may_call:
            return None
        fmt = tool_format(await self.fleet.chat_template(parsed.generate.model))
        parsed.generate.tools_json = tools.tools_json()
        if tools.forced:
            parallel = tools.parallel and tools.choice == "required"
            grammar = call_grammar(tools.forced, fmt, parallel=parallel)
            parsed.generate.sampling_params.structured_outputs.lark_grammar = grammar
        return ToolCallParser(fmt, parallel=tools.parallel)

    async def _first(self, parsed: ParsedRequest, stream: Stream) -> pb.GenerateResponse:
        try:
            return await anext(stream)
        except (ContextTooLong, OutOfVocabulary) as exc:
            raise limit_error(parsed.kind, exc) from exc

    async def _until_disconnect(self, request: Request, work: Awaitable[T]) -> T:
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

    async def _events(
        self,
        reply: Reply,
        first: pb.GenerateResponse,
        stream: Stream,
        route: str,
    ) -> AsyncIterator[bytes]:
        last = first
        try:
            async for message in _chain(first, stream):
                last = message
                texts = await self._texts(reply.parsed, [message])
                logprobs = shown_logprobs(message, texts)
                if reply.tools is not None:
                    found = reply.tools.feed(message.text)
                    if message.finish_reason:
                        found += reply.tools.finish()
                    shown = reply.logprobs(logprobs, texts) if logprobs else None
                    for chunk in reply.events(found, shown):
                        yield sse(chunk)
                elif message.text or logprobs:
                    yield sse(reply.chunk(message.text, reply.logprobs(logprobs, texts)))
                if message.finish_reason:
                    yield sse(reply.chunk("", None, message.finish_reason))
        except (WorkerError, ClientError, ApiError) as exc:
            # The headers are out: the error travels as an event, as OpenAI sends it.
            yield sse(_api_error(exc).body())
            return
        except asyncio.CancelledError:  # the client went away mid-stream
            self.metrics.disconnects.labels(route).inc()
            raise
        finally:
            await stream.aclose()
        self._count(last)
        if reply.parsed.include_usage:
            yield sse(reply.usage_chunk(last))
        yield b"data: [DONE]\n\n"

    async def _texts(
        self, parsed: ParsedRequest, messages: list[pb.GenerateResponse]
    ) -> dict[int, str]:
        if parsed.logprobs is None:
            return {}
        try:
            texts = self.texts(parsed.generate.model)
            return await texts.lookup(token_ids(lp for m in messages for lp in m.logprobs))
        except (WorkerError, ClientError) as exc:
            raise _api_error(exc) from exc

    def _count(self, last: pb.GenerateResponse) -> None:
        self.metrics.tokens.labels("prompt").inc(last.prompt_tokens)
        self.metrics.tokens.labels("completion").inc(last.completion_tokens)


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


async def _fleet_call(work: Awaitable[T]) -> T:
    """Awaits a fleet call; its errors become OpenAI errors."""
    try:
        return await work
    except (WorkerError, ClientError) as exc:
        raise _api_error(exc) from exc
    except StopAsyncIteration as exc:  # the fleet always ends with a finish reason
        raise ApiError(
            500, "the fleet ended the request without an answer", kind="server_error"
        ) from exc


def _api_error(exc: WorkerError | ClientError | ApiError) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientError):
        return from_grpc(exc.code, exc.details)
    return from_grpc(grpc_code(exc.code), exc.message)


def _no_such_model(name: str) -> ApiError:
    return ApiError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(
        exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind=kind
    )
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    error = ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(fleet: FleetScheduler, config: GatewayConfig | None = None) -> Starlette:
    """The gateway's ASGI app; its lifespan starts and stops `fleet`."""
    config = config or GatewayConfig()
    gateway = Gateway(fleet, config)
    routes = [
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route(HEALTH_PATH, gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    middleware = [Middleware(MetricsMiddleware, metrics=gateway.metrics, routes=routes)]
    check = token_check(config.security)
    if check is not None:
        open_paths = [HEALTH_PATH] if config.security.allow_health_without_token else []
        middleware.append(Middleware(ApiKeyMiddleware, check=check, open_paths=open_paths))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=gateway.lifespan,
        exception_handlers={
            ApiError: _api_error_response,
            HTTPException: _http_error_response,
            Exception: _internal_error_response,
        },
    )
    app.state.gateway = gateway
    return app
