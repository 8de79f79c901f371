"""A typed client for WorkerService: `AsyncWorkerClient` (grpc.aio) and `WorkerClient` (sync).

Every RPC of `mlx_worker.v1.WorkerService` has one method, named in snake_case
(`InitDevice` -> `init_device`), that takes the request message and returns the
response message; `generate` yields the stream's messages and `health` asks the
standard `grpc.health.v1` service. `WorkerClient` is the same client for code
without an event loop: it runs an `AsyncWorkerClient` on a private event-loop
thread, so both share one implementation (and the sync client may be used from
several threads at once).

Deadlines
    Every unary call gets a deadline: `ClientConfig.timeout` (30 s) unless the
    call passes `timeout=`, and `ClientConfig.execute_timeout` (600 s) for
    Execute, whose step may be a long prefill. The deadline is per attempt (a
    retried call may take up to `(retries + 1) x timeout` plus the backoff).
    LoadModel of a large hub model or WakeUp after a level-2 Sleep reload
    weights: give them a longer `timeout=`. Generate has no deadline unless
    one is passed; stop a stream by leaving the loop and closing the iterator
    (`aclose()` / `close()`, or let it go out of scope), which cancels the RPC
    and the worker frees the request.

Retries
    Only idempotent calls are retried, on UNAVAILABLE (no connection, the
    server restarting) and DEADLINE_EXCEEDED, up to `retries` more times with
    exponential backoff (`backoff` doubling up to `max_backoff`) and jitter.
    They are the lifecycle calls (InitDevice, LoadModel, DetermineMemory,
    InitCache, WarmUp: a repeat with the same arguments joins the worker's call
    in progress, or gets the result of the one just done, instead of queueing
    more work), the read-only calls (CheckHealth, GetInfo, Tokenize, Detokenize,
    ListLoras, the grpc.health.v1 Check), WakeUp (a no-op when awake),
    PinLora and ResetPrefixCache. Execute, Generate, Sleep, Shutdown, AddLora, RemoveLora,
    StartProfile and StopProfile change state in ways a blind repeat could
    double or lose (a step run twice, a stream restarted, requests aborted
    twice, a profile's report), so they are tried once
    and the caller (the scheduler) decides. Any other status code fails at
    once. Every failure, after the retries, is a `ClientError` carrying the
    status code, the server's details, the RPC name and the attempts made.

Credentials and the token
    `ClientConfig.credentials` (`channel_credentials(ca, cert, key)`, with a
    client key and certificate for mTLS) makes the channel secure; without it
    the channel is plaintext. `ClientConfig.token` is sent on every call as
    `authorization: Bearer <token>` metadata, which a worker or fleet started
    with tokens checks (mlx_worker_svc.rpc.security); send it only over a secure
    channel or a trusted network.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Coroutine, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import grpc
import grpc.aio
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from mlx_worker_svc.client import rpcs
from mlx_worker_svc.client.config import ClientConfig, channel_credentials
from mlx_worker_svc.client.errors import ClientError, client_error
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from mlx_worker_svc.client.step_stream import AsyncExecuteStream

IDEMPOTENT_METHODS = rpcs.IDEMPOTENT_METHODS

__all__ = [
    "IDEMPOTENT_METHODS",
    "AsyncWorkerClient",
    "ClientConfig",
    "ClientError",
    "WorkerClient",
    "channel_credentials",
]

log = logging.getLogger(__name__)

ReqT = TypeVar("ReqT", bound=Message)
RespT = TypeVar("RespT", bound=Message)
T = TypeVar("T")

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class AsyncWorkerClient:
    """WorkerService over one grpc.aio channel.

    Make it inside a coroutine and use it on that event loop only (the channel
    binds to the running loop); `WorkerClient` is the one for other threads.
    """

    def __init__(self, target: str, config: ClientConfig | None = None) -> None:
        self._target = target
        self._config = config or ClientConfig()
        options = self._config.channel_options()
        if self._config.credentials is not None:
            self._channel = grpc.aio.secure_channel(target, self._config.credentials, options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self._config.token}"),) if self._config.token else ()
        )
        self._unary_calls = {
            rpc.path: self._channel.unary_unary(
                rpc.path, rpc.request.SerializeToString, rpc.response.FromString
            )
            for rpc in rpcs.UNARY
        }
        self._generate_call = self._channel.unary_stream(
            rpcs.GENERATE_PATH, pb.GenerateRequest.SerializeToString, pb.GenerateResponse.FromString
        )
        self._execute_stream_call = self._channel.stream_stream(
            rpcs.EXECUTE_STREAM_PATH,
            pb.ExecuteStreamRequest.SerializeToString,
            pb.ExecuteStreamResponse.FromString,
        )

    @property
    def target(self) -> str:
        return self._target

    @property
    def config(self) -> ClientConfig:
        return self._config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target!r})"

    async def close(self) -> None:
        """Closes the channel; calls still open are cancelled."""
        await self._channel.close(None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _call(
        self, rpc: rpcs.Rpc[ReqT, RespT], request: ReqT | None, timeout: float | None
    ) -> RespT:
        """One unary RPC with its deadline, the token and (when idempotent) retries."""
        if request is None:
            request = rpc.request()
        elif not isinstance(request, rpc.request):
            raise TypeError(
                f"{rpc.name} takes {rpc.request.__name__}, not {type(request).__name__}"
            )
        if timeout is None:
            timeout = self._config.execute_timeout if rpc.long else self._config.timeout
        attempts = 1 + (self._config.retries if rpc.idempotent else 0)
        call = self._unary_calls[rpc.path]
        for attempt in range(1, attempts + 1):
            try:
                return cast(RespT, await call(request, timeout=timeout, metadata=self._metadata))
            except grpc.aio.AioRpcError as exc:
                if attempt == attempts or exc.code() not in _RETRYABLE:
                    raise client_error(exc, rpc.name, attempt) from exc
                delay = self._config.backoff_delay(attempt - 1)
                log.info(
                    "%s to %s: %s (%s); retry %d of %d in %.3fs",
                    rpc.name,
                    self._target,
                    exc.code().name,
                    exc.details(),
                    attempt,
                    attempts - 1,
                    delay,
                )
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    # One method per unary RPC of WorkerService, from the table above.
    init_device = rpcs.AsyncMethod(rpcs.INIT_DEVICE)
    load_model = rpcs.AsyncMethod(rpcs.LOAD_MODEL)
    determine_memory = rpcs.AsyncMethod(rpcs.DETERMINE_MEMORY)
    init_cache = rpcs.AsyncMethod(rpcs.INIT_CACHE)
    warm_up = rpcs.AsyncMethod(rpcs.WARM_UP)
    execute = rpcs.AsyncMethod(rpcs.EXECUTE)
    check_health = rpcs.AsyncMethod(rpcs.CHECK_HEALTH)
    shutdown = rpcs.AsyncMethod(rpcs.SHUTDOWN)
    get_info = rpcs.AsyncMethod(rpcs.GET_INFO)
    tokenize = rpcs.AsyncMethod(rpcs.TOKENIZE)
    detokenize = rpcs.AsyncMethod(rpcs.DETOKENIZE)
    sleep = rpcs.AsyncMethod(rpcs.SLEEP)
    wake_up = rpcs.AsyncMethod(rpcs.WAKE_UP)
    reset_prefix_cache = rpcs.AsyncMethod(rpcs.RESET_PREFIX_CACHE)
    add_lora = rpcs.AsyncMethod(rpcs.ADD_LORA)
    remove_lora = rpcs.AsyncMethod(rpcs.REMOVE_LORA)
    pin_lora = rpcs.AsyncMethod(rpcs.PIN_LORA)
    list_loras = rpcs.AsyncMethod(rpcs.LIST_LORAS)
    start_profile = rpcs.AsyncMethod(rpcs.START_PROFILE)
    stop_profile = rpcs.AsyncMethod(rpcs.STOP_PROFILE)

    async def health(self, service: str = "", *, timeout: float | None = None) -> int:
        """grpc.health.v1 Check: a `HealthCheckResponse.ServingStatus` value (retried).

        "" is the whole server; "mlx_worker.v1.WorkerService" is SERVING only
        while the worker accepts Execute and Generate.
        """
        request = health_pb2.HealthCheckRequest(service=service)
        return int((await self._call(rpcs.HEALTH_CHECK, request, timeout)).status)

    async def generate(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Streams a Generate call (never retried; no deadline unless `timeout`).

        Leaving the loop early and closing the iterator (`aclose()`, or
        dropping it) cancels the RPC, and the worker frees the request.
        """
        if not isinstance(request, pb.GenerateRequest):
            raise TypeError(f"Generate takes GenerateRequest, not {type(request).__name__}")
        call = self._generate_call(request, timeout=timeout, metadata=self._metadata)
        try:
            async for message in call:
                yield cast(pb.GenerateResponse, message)
        except grpc.aio.AioRpcError as exc:
            raise client_error(exc, "Generate") from exc
        finally:
            call.cancel()

    def execute_stream(self) -> AsyncExecuteStream:
        """Opens an ExecuteStream (never retried, no deadline); see client.step_stream."""
        from mlx_worker_svc.client.step_stream import AsyncExecuteStream  # it imports this module

        return AsyncExecuteStream(self._execute_stream_call(None, metadata=self._metadata))


class WorkerClient:
    """The synchronous client: an `AsyncWorkerClient` on a private event-loop thread.

    Thread-safe: calls from several threads run concurrently on the one channel.
    """

    def __init__(self, target: str, config: ClientConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"WorkerClient({target})", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> AsyncWorkerClient:  # the channel binds to the running loop
            return AsyncWorkerClient(target, config)

        try:
            self._client = self._run(make())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def target(self) -> str:
        return self._client.target

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r})"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self!r} is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: cancel the RPC too
            raise

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        """Closes the channel and stops the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            self._run(self._client.close())
            self._run(self._loop.shutdown_asyncgens())
        finally:
            self._stop_loop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # The same methods, run on the event-loop thread.
    init_device = rpcs.SyncMethod(rpcs.INIT_DEVICE)
    load_model = rpcs.SyncMethod(rpcs.LOAD_MODEL)
    determine_memory = rpcs.SyncMethod(rpcs.DETERMINE_MEMORY)
    init_cache = rpcs.SyncMethod(rpcs.INIT_CACHE)
    warm_up = rpcs.SyncMethod(rpcs.WARM_UP)
    execute = rpcs.SyncMethod(rpcs.EXECUTE)
    check_health = rpcs.SyncMethod(rpcs.CHECK_HEALTH)
    shutdown = rpcs.SyncMethod(rpcs.SHUTDOWN)
    get_info = rpcs.SyncMethod(rpcs.GET_INFO)
    tokenize = rpcs.SyncMethod(rpcs.TOKENIZE)
    detokenize = rpcs.SyncMethod(rpcs.DETOKENIZE)
    sleep = rpcs.SyncMethod(rpcs.SLEEP)
    wake_up = rpcs.SyncMethod(rpcs.WAKE_UP)
    reset_prefix_cache = rpcs.SyncMethod(rpcs.RESET_PREFIX_CACHE)
    add_lora = rpcs.SyncMethod(rpcs.ADD_LORA)
    remove_lora = rpcs.SyncMethod(rpcs.REMOVE_LORA)
    pin_lora = rpcs.SyncMethod(rpcs.PIN_LORA)
    list_loras = rpcs.SyncMethod(rpcs.LIST_LORAS)
    start_profile = rpcs.SyncMethod(rpcs.START_PROFILE)
    stop_profile = rpcs.SyncMethod(rpcs.STOP_PROFILE)

    def health(self, service: str = "", *, timeout: float | None = None) -> int:
        """See `AsyncWorkerClient.health`."""
        return self._run(self._client.health(service, timeout=timeout))

    def generate(
        self, request: pb.GenerateRequest, *, timeout: float | None = None
    ) -> Generator[pb.GenerateResponse, None, None]:
        """See `AsyncWorkerClient.generate`; closing the iterator cancels the RPC."""
        stream = self._client.generate(request, timeout=timeout)

        async def step() -> pb.GenerateResponse | None:
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

        try:
            while (message := self._run(step())) is not None:
                yield message
        finally:
            if not self._closed:
                self._run(stream.aclose())
