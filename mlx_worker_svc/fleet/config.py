"""How the fleet drives each worker (`LinkConfig`: batching, probes, deadlines) and
queues and routes requests over them (`FleetConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mlx_worker_svc.client.worker import ClientConfig

Routing = Literal["prefix", "least-loaded"]


@dataclass(frozen=True)
class LinkConfig:
    model: str = ""  # LoadModel's model for a worker that has none loaded
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Decode steps per Execute call once every running request decodes
    # (ExecuteRequest.num_decode_steps): fewer round trips, coarser streaming.
    decode_steps: int = 1
    # Steps sent ahead of the oldest reply through ExecuteStream (pipeline.py);
    # 0: one unary Execute at a time.
    steps_ahead: int = 1
    num_blocks: int = 0  # 0: the worker's suggestion
    # The KV format the link asks of a worker it brings up (DetermineMemory and
    # InitCache kv_bits / kv_group_size); 0: float KV.
    kv_bits: int = 0
    kv_group_size: int = 0
    # A lost worker is probed again after retry_backoff s, doubling to max_backoff.
    retry_backoff: float = 0.5
    max_backoff: float = 2.0
    # Health probes, while idle or waiting longer than probe_interval s for a
    # step's reply (a reply shows the worker lives): one CheckHealth every
    # probe_interval s, each one attempt with a probe_timeout s deadline;
    # probe_misses timeouts in a row take the worker as hung (a refused
    # connection at once), so a hang is found within
    # probe_misses x (probe_interval + probe_timeout) s.
    probe_interval: float = 1.0
    probe_timeout: float = 2.0
    probe_misses: int = 2
    # Deadline of each lifecycle call (LoadModel, DetermineMemory, ...) the link makes.
    lifecycle_timeout: float = 600.0
    client: ClientConfig = field(default_factory=ClientConfig)

    def __post_init__(self) -> None:
        if min(self.probe_interval, self.probe_timeout, self.lifecycle_timeout) <= 0:
            raise ValueError("probe_interval, probe_timeout and lifecycle_timeout must be > 0")
        if self.steps_ahead < 0:
            raise ValueError(f"steps_ahead must be >= 0, got {self.steps_ahead}")
        if self.probe_misses < 1:
            raise ValueError(f"probe_misses must be >= 1, got {self.probe_misses}")

    @property
    def detection_seconds(self) -> float:
        """The longest a hung worker keeps its requests."""
        return self.probe_misses * (self.probe_interval + self.probe_timeout)


@dataclass(frozen=True)
class FleetConfig:
    link: LinkConfig = field(default_factory=LinkConfig)
    queue_capacity: int = 256
    routing: Routing = "prefix"
    affinity_tokens: int = 256
    # How long a request may wait for a worker of its model to be up before it
    # fails (a configured model waits as long as some worker is up or loading).
    no_worker_timeout: float = 30.0
    # The models to load on demand, name -> path (`fleet --models NAME=PATH`).
    models: Mapping[str, str] = field(default_factory=dict)
    # LoRA adapters the fleet loads on a worker when none holds one, name -> path
    # (`fleet --lora-modules NAME=PATH`; fleet/adapters.py).
    lora_modules: Mapping[str, str] = field(default_factory=dict)
    # The model each of them runs on, name -> model name (vLLM's base_model_name);
    # unset: the model of a worker holding it, else the fleet's only model.
    lora_bases: Mapping[str, str] = field(default_factory=dict)
