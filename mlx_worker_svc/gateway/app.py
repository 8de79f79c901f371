"""The gateway's HTTP API over an in-process `FleetScheduler` (a Starlette app).

Routes: OpenAI's `/v1/models`, `/v1/chat/completions` and `/v1/completions`
(both with and without server-sent events), Anthropic's `/v1/messages` and
`/v1/messages/count_tokens` (anthropic/), `/health` and `/metrics`. A
completion is one `FleetScheduler.generate` call, run by calls.py: the request
is validated first (`schema.parse_request`), the fleet's first message is
awaited before any header goes out, and from then on every fleet message
becomes a chunk. Errors answer in the shape of the API whose route was called
(`errors.error_body`). Every route resolves the request's model through
`Gateway.model_for`: each model of the fleet is served by its name, and an
unknown one is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client import generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.fleet import FleetScheduler
from mlx_worker_svc.gateway import request_ids
from mlx_worker_svc.gateway.anthropic.routes import MessagesApi
from mlx_worker_svc.gateway.auth import ApiKeyMiddleware
from mlx_worker_svc.gateway.body import parse_body
from mlx_worker_svc.gateway.calls import (
    CLIENT_CLOSED,
    Answer,
    ClientGone,
    answer_error,
    api_error,
    event_stream,
    open_answer,
    sse,
)
from mlx_worker_svc.gateway.choices import all_or_none, combine, combined_usage, fan_out, merge
from mlx_worker_svc.gateway.errors import ApiError, error_body, invalid
from mlx_worker_svc.gateway.metrics import CONTENT_TYPE, GatewayMetrics, MetricsMiddleware
from mlx_worker_svc.gateway.paging import page
from mlx_worker_svc.gateway.request_ids import RequestIdMiddleware
from mlx_worker_svc.gateway.responses import Reply, TokenTexts, shown_logprobs, token_ids
from mlx_worker_svc.gateway.schema import OpenAIKind, ParsedRequest, parse_request
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import SecurityConfig, token_check

HEALTH_PATH = "/health"


@dataclass(frozen=True)
class GatewayConfig:
    """What the app serves: the model name it answers to and the API keys (`security.tokens`)."""

    served_model_name: str | None = None
    """The model id of a one-model fleet; default: the fleet's names for its models."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    allowed_origins: tuple[str, ...] = ()
    """Origins whose browsers' CORS requests are answered ("*": any); none: no CORS."""


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
        """The served models: the configured name, or the fleet's (`FleetScheduler.models`),
        then the LoRA adapters (vLLM's `--lora-modules`: each is a model id of its own)."""
        if self.config.served_model_name:
            return [self.config.served_model_name, *self.adapter_parents()]
        return [*self.fleet.models(), *self.adapter_parents()]

    def adapter_parents(self) -> dict[str, str]:
        """Adapter -> the model id it runs on (its `parent` in /v1/models)."""
        fleet = self.fleet
        parents = fleet.adapters.parents(fleet.links, fleet.models())
        served = self.config.served_model_name
        return {name: served or parent for name, parent in sorted(parents.items())}

    def texts(self, model: str) -> TokenTexts:
        """The token-text cache of one model (GenerateRequest.model)."""
        if model not in self._texts_by_model:
            self._texts_by_model[model] = TokenTexts(partial(self.fleet.detokenize, model=model))
        return self._texts_by_model[model]

    def _model_card(self, name: str) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's `root` and `parent` (an adapter's base model)
        and Anthropic's `type`, `display_name` and `created_at` (its SDK's models.list)."""
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "mlx-worker"}
        parent = self.adapter_parents().get(name)
        root = self.fleet.adapters.configured.get(name, name) if parent is not None else name
        when = datetime.datetime.fromtimestamp(self.created, datetime.UTC).isoformat()
        anthropic = {"type": "model", "display_name": name, "created_at": when}
        return {**card, "root": root, "parent": parent, **anthropic}

    async def list_models(self, request: Request) -> JSONResponse:
        await self.fleet.refresh_adapters()  # adapters added to a worker from outside
        # OpenAI's list, with Anthropic's paging (paging.py).
        names = page(self.model_names(), request.query_params)
        cards = [self._model_card(n) for n in names.ids]
        first, last = (names.ids[0], names.ids[-1]) if names.ids else (None, None)
        paging = {"has_more": names.has_more, "first_id": first, "last_id": last}
        return JSONResponse({"object": "list", "data": cards, **paging})

    async def get_model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        await self._known(name)
        if name not in self.model_names():
            raise _no_such_model(name)
        return JSONResponse(self._model_card(name))

    async def _known(self, name: str | None) -> None:
        """Reads the workers' adapters again when `name` is no model id served: it may be
        an adapter a worker was given from outside the fleet since it came up."""
        if name and name not in self.model_names():
            await self.fleet.refresh_adapters(name)

    async def model_for(self, parsed: ParsedRequest) -> str:
        """Resolves the request's model (`resolve_model`) and routes its GenerateRequest
        there; returns the id its answer carries."""
        await self._known(parsed.model)
        shown, parsed.generate.model = self.resolve_model(parsed.model)
        parsed.generate.lora_name = shown if shown in self.adapter_parents() else ""
        return shown

    def resolve_model(self, asked: str | None) -> tuple[str, str]:
        """(the id answers carry, the fleet's GenerateRequest.model) for a request's `model`.

        Unknown: 404; unset while the fleet serves several: 400. With no worker
        up yet (and nothing configured) the name cannot be checked: the fleet
        waits for a worker and answers NOT_FOUND (404) itself.
        """
        names = self.model_names()
        if not asked:  # unset, null or "": as vLLM, the only model
            if len(names) > 1:
                raise invalid("model", f"the gateway serves {len(names)} models: {names}")
            return (names[0] if names else "unknown"), ""
        if names and asked not in names:
            raise _no_such_model(asked)
        if self.config.served_model_name:
            return asked, ""
        model = self.adapter_parents().get(asked, asked)  # an adapter runs on its parent
        if not model:  # an adapter no worker holds, of a fleet of several models
            raise invalid(
                "model",
                f"adapter {asked!r} has no known base model: no worker holds it and the "
                "gateway serves several models (its --lora-modules entry needs base_model_name)",
            )
        return asked, model

    # -------------------------------------------------- health, metrics
    async def health(self, request: Request) -> JSONResponse:
        status = self.fleet.status()
        up = sum(w.up for w in status.workers)
        state = "ok" if up else "unavailable"
        if self.fleet.draining:  # shutting down: send traffic elsewhere (its workers are up)
            state = "draining"
        body = {
            "status": state,
            "workers_up": up,
            "workers": len(status.workers),
            "queued": status.num_queued,
        }
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    async def prometheus(self, request: Request) -> Response:
        # The fleet's collectors read its state on this loop, so they run in a thread.
        fleet = await asyncio.to_thread(generate_latest, self.fleet.metrics.registry)
        return Response(self.metrics.render() + fleet, media_type=CONTENT_TYPE)

    # ------------------------------------------------------ completions
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: OpenAIKind) -> Response:
        route = request.url.path
        parsed = parse_request(kind, parse_body(await request.body()), request_ids.base(request))
        request_ids.answered(request, parsed.id)
        model = await self.model_for(parsed)
        capacity = self.fleet.config.queue_capacity
        if parsed.n > capacity:  # every choice passes through the queue: it could never fit
            raise invalid(
                "n",
                f"{parsed.n} choices are {parsed.n} requests, more than the fleet's queue "
                f"holds ({capacity}, the gateway's --queue)",
            )
        try:
            start = time.monotonic()  # the answer begins once every choice has its first token
            opening = [open_answer(self.fleet, request, c, None) for c in fan_out(parsed)]
            answers = await all_or_none(opening, _close)
            self.metrics.ttft.labels(route).observe(time.monotonic() - start)
            replies = []
            for index, answer in enumerate(answers):
                reply = Reply(answer.parsed, model, answer.tools, index)
                reply.cached_tokens = answer.first.num_cached_prompt_tokens
                replies.append(reply)
            if parsed.stream:
                return event_stream(self._events(parsed, replies, answers, route))
            collected = await all_or_none([answer.collect(request) for answer in answers])
        except ClientGone:
            self.metrics.disconnects.labels(route).inc()
            return Response(status_code=CLIENT_CLOSED)
        bodies = []
        for reply, messages in zip(replies, collected, strict=True):
            texts = await self._texts(parsed, messages)
            bodies.append(reply.complete(messages, texts))
        self.count(*(messages[-1] for messages in collected))
        return JSONResponse(combine(bodies))

    async def _events(
        self, parsed: ParsedRequest, replies: list[Reply], answers: list[Answer], route: str
    ) -> AsyncIterator[bytes]:
        """The stream of every choice's chunks, interleaved as they come (choices.merge)."""
        lasts = [answer.first for answer in answers]
        chunks = [self._chunks(r, a, lasts) for r, a in zip(replies, answers, strict=True)]
        try:
            async for chunk in merge(chunks):
                yield sse(chunk)
        except (WorkerError, ClientError, ApiError) as exc:
            # The headers are out: the error travels as an event, as OpenAI sends it.
            yield sse(answer_error(parsed, exc).body())
            return
        except asyncio.CancelledError:  # the client went away mid-stream
            self.metrics.disconnects.labels(route).inc()
            raise
        finally:
            for answer in answers:  # the fleet frees each request now, whatever ended it
                await answer.stream.aclose()
        self.count(*lasts)
        if parsed.include_usage:
            usage = replies[0].usage_chunk(lasts[0])
            usages = [r.usage(m) for r, m in zip(replies, lasts, strict=True)]
            usage["usage"] = combined_usage(usages)
            yield sse(usage)
        yield b"data: [DONE]\n\n"

    async def _chunks(
        self, reply: Reply, answer: Answer, lasts: list[pb.GenerateResponse]
    ) -> AsyncIterator[dict[str, Any]]:
        """One choice's chunks; its last message goes to `lasts[reply.index]`."""
        async for message in answer.messages():
            lasts[reply.index] = message
            texts = await self._texts(reply.parsed, [message])
            logprobs = shown_logprobs(message, texts)
            if reply.tools is not None:
                found = reply.tools.feed(message.text)
                if message.finish_reason:
                    found += reply.tools.finish()
                shown = reply.logprobs(logprobs, texts) if logprobs else None
                for chunk in reply.events(found, shown):
                    yield chunk
            elif message.text or logprobs:
                yield reply.chunk(message.text, reply.logprobs(logprobs, texts))
            if message.finish_reason:
                yield reply.chunk("", None, message.finish_reason)

    async def _texts(
        self, parsed: ParsedRequest, messages: list[pb.GenerateResponse]
    ) -> dict[int, bytes]:
        if parsed.logprobs is None:
            return {}
        try:
            texts = self.texts(parsed.generate.model)
            return await texts.lookup(token_ids(lp for m in messages for lp in m.logprobs))
        except (WorkerError, ClientError) as exc:
            raise api_error(exc) from exc

    def count(self, last: pb.GenerateResponse, *more: pb.GenerateResponse) -> None:
        """Counts a finished answer's prompt and completion tokens, from the last message
        of each of its choices (the prompt once, as the answer's usage does)."""
        self.metrics.tokens.labels("prompt").inc(last.prompt_tokens)
        completion = sum(m.completion_tokens for m in (last, *more))
        self.metrics.tokens.labels("completion").inc(completion)


async def _close(answer: Answer) -> None:
    """Frees an opened choice whose request failed as a whole."""
    await answer.stream.aclose()


def _no_such_model(name: str) -> ApiError:
    return ApiError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


# A 429's Retry-After: the fleet's queue drains as answers end, in about a second under load
# (the SDKs wait this long before their retry instead of their own backoff).
RETRY_AFTER_SECONDS = 1


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.status == 429 else None
    body = error_body(request.url.path, exc, request.headers.keys())
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    error = ApiError(
        exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind=kind
    )
    body = error_body(request.url.path, error, request.headers.keys())
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    error = ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
    return JSONResponse(
        error_body(request.url.path, error, request.headers.keys()), status_code=500
    )


def create_app(fleet: FleetScheduler, config: GatewayConfig | None = None) -> Starlette:
    """The gateway's ASGI app; its lifespan starts and stops `fleet`."""
    config = config or GatewayConfig()
    gateway = Gateway(fleet, config)
    messages = MessagesApi(gateway.fleet, gateway.metrics, gateway.model_for, gateway.count)
    routes = [
        Route("/v1/models", gateway.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.get_model, methods=["GET"]),
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/messages", messages.create, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route(HEALTH_PATH, gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    middleware = [
        Middleware(RequestIdMiddleware),  # first: a 401 carries its request id too
        Middleware(MetricsMiddleware, metrics=gateway.metrics, routes=routes),
    ]
    check = token_check(config.security)
    if check is not None:
        open_paths = [HEALTH_PATH] if config.security.allow_health_without_token else []
        middleware.append(Middleware(ApiKeyMiddleware, check=check, open_paths=open_paths))
    if config.allowed_origins:  # outermost: a preflight carries no API key
        cors = Middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["*"],
        )
        middleware.insert(0, cors)
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
