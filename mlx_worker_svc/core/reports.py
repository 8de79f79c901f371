"""What the worker reports about itself: lifecycle state, device, model, memory, health.

These are the answers of InitDevice, LoadModel, GetInfo, Sleep, WakeUp and Health (and
LoadModel's request, `LoadSpec`), as plain dataclasses the servicer converts. The
KV budget types they embed (`KVUsage`, `KVFormat`) belong to the step contract in
`domain.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlx_worker_svc.core.domain import DeviceKind, KVUsage


class WorkerState(enum.Enum):
    NEW = "NEW"
    DEVICE_READY = "DEVICE_READY"
    MODEL_LOADED = "MODEL_LOADED"
    MEMORY_PROFILED = "MEMORY_PROFILED"
    READY = "READY"
    SERVING = "SERVING"
    SLEEPING = "SLEEPING"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"


class Parallelism(enum.Enum):
    """How a model is split over a worker group's ranks."""

    NONE = "none"  # one process holds the whole model
    TENSOR = "tensor"  # every rank holds a slice of every layer
    PIPELINE = "pipeline"  # every rank holds a run of whole layers


@dataclass(frozen=True)
class GroupRank:
    """One process of a worker group, as InitDevice and GetInfo report it."""

    rank: int
    host: str
    local_rank: int
    pid: int
    device_name: str
    total_memory_bytes: int
    recommended_working_set_bytes: int
    weight_bytes: int = 0
    """Bytes of the model shard this rank holds (0 before LoadModel)."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: DeviceKind
    name: str
    total_memory_bytes: int
    recommended_working_set_bytes: int
    mlx_version: str
    mlx_lm_version: str
    platform: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = ""
    """The mx.distributed backend of a worker group ("" for one process)."""
    ranks: tuple[GroupRank, ...] = ()


@dataclass(frozen=True)
class Quantization:
    bits: int = 0
    group_size: int = 0
    mode: str = ""


@dataclass(frozen=True)
class ModelInfo:
    model: str
    model_path: str
    model_type: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    quantization: Quantization
    weight_bytes: int
    dtype: str
    has_chat_template: bool
    adapter_path: str = ""
    parallelism: Parallelism = Parallelism.NONE


@dataclass(frozen=True)
class LoadSpec:
    """What LoadModel was asked for; equal specs make LoadModel a no-op."""

    model: str
    adapter_path: str = ""
    max_model_len: int = 0
    revision: str = ""
    trust_remote_code: bool = False


@dataclass(frozen=True)
class MemoryUsage:
    active_bytes: int = 0
    peak_bytes: int = 0
    cache_bytes: int = 0
    limit_bytes: int = 0


@dataclass(frozen=True)
class SleepReport:
    state: WorkerState
    level: int
    num_aborted: int
    freed_bytes: int
    worker_epoch: int


@dataclass(frozen=True)
class WakeReport:
    state: WorkerState
    worker_epoch: int
    seconds: float
    # Adapters resident before a level-2 Sleep that could not be loaded again (their
    # files gone or changed): the worker woke without them.
    dropped_loras: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthReport:
    state: WorkerState
    healthy: bool
    num_running_requests: int
    num_preempted_requests: int
    kv: KVUsage
    last_error: str
    worker_epoch: int
    deep_check_ns: int
    uptime_seconds: float
    memory: MemoryUsage
    bringing_up: bool = False
    """The worker is taking itself through its lifecycle (serve --auto-init)."""
