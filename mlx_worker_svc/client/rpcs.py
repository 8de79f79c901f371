"""WorkerService's unary RPCs as one table, and the client methods made from it.

Each `_Rpc` entry names an RPC, its message types, whether it may be retried
(`IDEMPOTENT_METHODS`), its deadline kind and its docstring. `AsyncMethod` and
`SyncMethod` turn an entry into the method of `AsyncWorkerClient` and of
`WorkerClient`: the async method runs `AsyncWorkerClient._call` (deadline,
token, retries), the sync one runs that on the client's event-loop thread. A
new RPC is one table entry and one line in each client.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar, overload

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

ReqT = TypeVar("ReqT", bound=Message)
RespT = TypeVar("RespT", bound=Message)
ReqT_contra = TypeVar("ReqT_contra", bound=Message, contravariant=True)
RespT_co = TypeVar("RespT_co", bound=Message, covariant=True)


@dataclass(frozen=True)
class Rpc(Generic[ReqT, RespT]):
    """One unary RPC: its path, message types and whether it may be retried."""

    name: str
    path: str
    request: type[ReqT]
    response: type[RespT]
    idempotent: bool
    doc: str
    long: bool = False  # deadline from execute_timeout


def _rpc(
    name: str,
    request: type[ReqT],
    response: type[RespT],
    idempotent: bool,
    doc: str,
    *,
    long: bool = False,
) -> Rpc[ReqT, RespT]:
    path = f"/mlx_worker.v1.WorkerService/{name}"
    return Rpc(name, path, request, response, idempotent, doc, long)


INIT_DEVICE = _rpc(
    "InitDevice",
    pb.InitDeviceRequest,
    pb.InitDeviceResponse,
    True,
    "Picks the device and reports it (retried).",
)
LOAD_MODEL = _rpc(
    "LoadModel",
    pb.LoadModelRequest,
    pb.LoadModelResponse,
    True,
    "Loads a model (retried: the same arguments again are a no-op).",
)
DETERMINE_MEMORY = _rpc(
    "DetermineMemory",
    pb.DetermineMemoryRequest,
    pb.DetermineMemoryResponse,
    True,
    "Profiles memory and reports the KV budget (retried).",
)
INIT_CACHE = _rpc(
    "InitCache", pb.InitCacheRequest, pb.InitCacheResponse, True, "Sets the KV budget (retried)."
)
WARM_UP = _rpc(
    "WarmUp",
    pb.WarmUpRequest,
    pb.WarmUpResponse,
    True,
    "Runs the scheduler's shapes once (retried).",
)
EXECUTE = _rpc(
    "Execute",
    pb.ExecuteRequest,
    pb.ExecuteResponse,
    False,
    "Runs one scheduler step (never retried; deadline `execute_timeout`).",
    long=True,
)
CHECK_HEALTH = _rpc(
    "CheckHealth",
    pb.CheckHealthRequest,
    pb.CheckHealthResponse,
    True,
    "State, load and the last error (retried).",
)
SHUTDOWN = _rpc(
    "Shutdown",
    pb.ShutdownRequest,
    pb.ShutdownResponse,
    False,
    "Drains (or aborts) in-flight work and stops the worker (never retried).",
)
GET_INFO = _rpc(
    "GetInfo", pb.GetInfoRequest, pb.GetInfoResponse, True, "Model and worker facts (retried)."
)
TOKENIZE = _rpc(
    "Tokenize",
    pb.TokenizeRequest,
    pb.TokenizeResponse,
    True,
    "Text or chat messages to token ids (retried).",
)
DETOKENIZE = _rpc(
    "Detokenize", pb.DetokenizeRequest, pb.DetokenizeResponse, True, "Token ids to text (retried)."
)
SLEEP = _rpc(
    "Sleep",
    pb.SleepRequest,
    pb.SleepResponse,
    False,
    "Frees the KV cache (level 1) and the weights (level 2); never retried.",
)
WAKE_UP = _rpc(
    "WakeUp",
    pb.WakeUpRequest,
    pb.WakeUpResponse,
    True,
    "Restores what Sleep freed (retried: a no-op when awake).",
)
RESET_PREFIX_CACHE = _rpc(
    "ResetPrefixCache",
    pb.ResetPrefixCacheRequest,
    pb.ResetPrefixCacheResponse,
    True,
    "Drops the prefix cache (retried).",
)
ADD_LORA = _rpc(
    "AddLora", pb.AddLoraRequest, pb.AddLoraResponse, False, "Loads a LoRA adapter (never retried)."
)
REMOVE_LORA = _rpc(
    "RemoveLora",
    pb.RemoveLoraRequest,
    pb.RemoveLoraResponse,
    False,
    "Unloads a LoRA adapter (never retried).",
)
PIN_LORA = _rpc(
    "PinLora",
    pb.PinLoraRequest,
    pb.PinLoraResponse,
    True,
    "Pins or unpins a LoRA adapter (retried: the same call again changes nothing).",
)
LIST_LORAS = _rpc(
    "ListLoras",
    pb.ListLorasRequest,
    pb.ListLorasResponse,
    True,
    "Lists loaded LoRA adapters (retried).",
)
START_PROFILE = _rpc(
    "StartProfile",
    pb.StartProfileRequest,
    pb.StartProfileResponse,
    False,
    "Starts a profile of the engine thread (never retried).",
)
STOP_PROFILE = _rpc(
    "StopProfile",
    pb.StopProfileRequest,
    pb.StopProfileResponse,
    False,
    "Stops the profile and returns its file and top entries (never retried).",
)
HEALTH_CHECK: Rpc[Any, Any] = Rpc(
    "Health.Check",
    "/grpc.health.v1.Health/Check",
    health_pb2.HealthCheckRequest,
    health_pb2.HealthCheckResponse,
    True,
    "grpc.health.v1 Check (retried).",
)
UNARY: tuple[Rpc[Any, Any], ...] = (
    INIT_DEVICE,
    LOAD_MODEL,
    DETERMINE_MEMORY,
    INIT_CACHE,
    WARM_UP,
    EXECUTE,
    CHECK_HEALTH,
    SHUTDOWN,
    GET_INFO,
    TOKENIZE,
    DETOKENIZE,
    SLEEP,
    WAKE_UP,
    RESET_PREFIX_CACHE,
    ADD_LORA,
    REMOVE_LORA,
    PIN_LORA,
    LIST_LORAS,
    START_PROFILE,
    STOP_PROFILE,
    HEALTH_CHECK,
)
GENERATE_PATH = "/mlx_worker.v1.WorkerService/Generate"
EXECUTE_STREAM_PATH = "/mlx_worker.v1.WorkerService/ExecuteStream"

IDEMPOTENT_METHODS: frozenset[str] = frozenset(rpc.name for rpc in UNARY if rpc.idempotent)
"""The calls retried on UNAVAILABLE and DEADLINE_EXCEEDED ("Health.Check" is grpc.health.v1)."""


class _AsyncClient(Protocol):
    """What an `AsyncMethod` needs of its client (`AsyncWorkerClient`)."""

    async def _call(
        self, rpc: Rpc[ReqT, RespT], request: ReqT | None, timeout: float | None
    ) -> RespT: ...


class _SyncClient(Protocol):
    """What a `SyncMethod` needs of its client (`WorkerClient`)."""

    @property
    def _client(self) -> _AsyncClient: ...

    def _run(self, coro: Coroutine[Any, Any, RespT]) -> RespT: ...


class AsyncCall(Protocol[ReqT_contra, RespT_co]):
    """An `AsyncWorkerClient` method: the request message (None: the empty one) in."""

    def __call__(
        self, request: ReqT_contra | None = None, *, timeout: float | None = None
    ) -> Coroutine[Any, Any, RespT_co]: ...


class SyncCall(Protocol[ReqT_contra, RespT_co]):
    """A `WorkerClient` method: the request message (None: the empty one) in."""

    def __call__(
        self, request: ReqT_contra | None = None, *, timeout: float | None = None
    ) -> RespT_co: ...


class AsyncMethod(Generic[ReqT, RespT]):
    """The `AsyncWorkerClient` method of one unary RPC, made from its table entry."""

    def __init__(self, rpc: Rpc[ReqT, RespT]) -> None:
        self._rpc = rpc
        self.__doc__ = rpc.doc

    @overload
    def __get__(self, client: None, owner: type) -> Self: ...
    @overload
    def __get__(self, client: _AsyncClient, owner: type) -> AsyncCall[ReqT, RespT]: ...
    def __get__(self, client: _AsyncClient | None, owner: type) -> Self | AsyncCall[ReqT, RespT]:
        if client is None:
            return self
        rpc = self._rpc

        async def call(request: ReqT | None = None, *, timeout: float | None = None) -> RespT:
            return await client._call(rpc, request, timeout)

        call.__doc__ = rpc.doc
        return call


class SyncMethod(Generic[ReqT, RespT]):
    """The `WorkerClient` method of one unary RPC: its async twin, run on the loop thread."""

    def __init__(self, rpc: Rpc[ReqT, RespT]) -> None:
        self._rpc = rpc
        self.__doc__ = rpc.doc

    @overload
    def __get__(self, client: None, owner: type) -> Self: ...
    @overload
    def __get__(self, client: _SyncClient, owner: type) -> SyncCall[ReqT, RespT]: ...
    def __get__(self, client: _SyncClient | None, owner: type) -> Self | SyncCall[ReqT, RespT]:
        if client is None:
            return self
        rpc = self._rpc

        def call(request: ReqT | None = None, *, timeout: float | None = None) -> RespT:
            return client._run(client._client._call(rpc, request, timeout))

        call.__doc__ = rpc.doc
        return call
