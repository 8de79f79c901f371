# Generated from protos/ by `make proto`. DO NOT EDIT.
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("target", "up", "state", "worker_epoch", "num_running", "kv", "prefix_hits", "cached_prompt_tokens", "num_finished", "num_failed_over", "last_error", "model", "model_name", "loading", "num_loads", "lora_adapters")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_OVER_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    target: str
    up: bool
    state: _worker_pb2.WorkerState
    worker_epoch: int
    num_running: int
    kv: _worker_pb2.KVUsage
    prefix_hits: int
    cached_prompt_tokens: int
    num_finished: int
    num_failed_over: int
    last_error: str
    model: str
    model_name: str
    loading: str
    num_loads: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target: _Optional[str] = ..., up: _Optional[bool] = ..., state: _Optional[_Union[_worker_pb2.WorkerState, str]] = ..., worker_epoch: _Optional[int] = ..., num_running: _Optional[int] = ..., kv: _Optional[_Union[_worker_pb2.KVUsage, _Mapping]] = ..., prefix_hits: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_failed_over: _Optional[int] = ..., last_error: _Optional[str] = ..., model: _Optional[str] = ..., model_name: _Optional[str] = ..., loading: _Optional[str] = ..., num_loads: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "path", "workers", "loading", "num_queued", "num_loads", "num_finished", "configured")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    workers: _containers.RepeatedScalarFieldContainer[str]
    loading: _containers.RepeatedScalarFieldContainer[str]
    num_queued: int
    num_loads: int
    num_finished: int
    configured: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., workers: _Optional[_Iterable[str]] = ..., loading: _Optional[_Iterable[str]] = ..., num_queued: _Optional[int] = ..., num_loads: _Optional[int] = ..., num_finished: _Optional[int] = ..., configured: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("workers", "num_queued", "queue_capacity", "num_finished", "num_rejected", "models")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    num_queued: int
    queue_capacity: int
    num_finished: int
    num_rejected: int
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., num_queued: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_rejected: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ...) -> None: ...
