"""What the fleet knows of one worker: its facts, its requests, and the views read of them.

`LinkState` holds what a worker's GetInfo said when it came up (`adopt`: its
KV budget and format, context, vocabulary, limits, chat template and
adapters), the requests queued (`waiting`), running and to be freed on it,
and the views routing, admission and Status read (`load`, `idle`, `holds`,
`status`). `WorkerLink` (link.py) drives the worker and keeps this up to date.
"""

from __future__ import annotations

from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.fleet.models import ModelCatalog
from mlx_worker_svc.fleet.pipeline import Pipeline
from mlx_worker_svc.fleet.request import FleetRequest
from mlx_worker_svc.fleet.step_outcome import Queues
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


class LinkState:
    def __init__(self, target: str, config: LinkConfig, catalog: ModelCatalog) -> None:
        self.target = target
        self.config = config
        self.catalog = catalog
        self.up = False
        self.reached = False  # its first bring-up ended (up, down or starting)
        self.epoch = 0
        self.model = ""
        self.model_name = ""  # the catalog's name for it
        self.loading = ""  # the model name being loaded on demand (load())
        self.num_loads = 0
        self.last_used = 0.0  # time.monotonic() of the last request routed or served here
        self.state = pb.WORKER_STATE_UNSPECIFIED
        self.num_blocks = 0
        self.block_size = 16
        self.kv_format = (0, 0)  # the worker's KV (bits, group size); (0, 0): float
        self.max_context = 0
        self.vocab_size = 0
        self.max_message = 0
        self.chat_template = ""  # the model's, as GetInfo reports it
        self.adapters: set[str] = set()  # LoRA adapters it holds (ListLoras; fleet/adapters.py)
        self.adapter_paths: dict[str, str] = {}  # those it held when it came up: their paths
        self.max_seqs = config.max_num_seqs
        self.waiting: list[FleetRequest] = []
        self.running: dict[str, FleetRequest] = {}
        self.to_free: list[str] = []
        self._queues = Queues(self.waiting, self.running, self.to_free)
        self.stats = fleet_pb2.WorkerStatus(target=target)
        self.last_error = ""
        self._pipe: Pipeline | None = None  # ExecuteStream, steps ahead (pipeline.py)

    def adopt(self, info: pb.GetInfoResponse, loras: dict[str, str]) -> None:
        """Takes the facts of a worker that came up (its GetInfo; `loras`: its adapters'
        paths by name)."""
        self.epoch, self.state = info.worker_epoch, info.state
        self.model = info.model.model_path
        self.model_name = self.catalog.name_of(info.model.model, info.model.model_path)
        self.chat_template, self.adapters, self.adapter_paths = (
            info.chat_template,
            set(loras),
            loras,
        )
        self.num_blocks, self.block_size = info.kv.num_blocks, info.kv.block_size or 16
        self.kv_format = (info.kv.kv_bits, info.kv.kv_group_size)
        self.max_context, self.vocab_size = info.model.max_context_length, info.model.vocab_size
        self.max_message = info.limits.max_message_bytes  # a request the worker takes
        # Never past what the worker admits (it would refuse the step).
        admitted = info.limits.max_running_requests or self.config.max_num_seqs
        self.max_seqs = min(self.config.max_num_seqs, admitted)
        # Steps ahead through ExecuteStream, within what the worker reads ahead
        # (a worker that does not state it is driven through unary Execute).
        ahead = min(self.config.steps_ahead, info.limits.max_steps_in_flight - 1)
        self._pipe = Pipeline(ahead) if ahead >= 1 else None

    @property
    def _in_flight(self) -> int:
        return len(self._pipe.in_flight) if self._pipe is not None else 0

    @property
    def load(self) -> float:
        """Least-loaded routing score: requests here plus the KV share in use."""
        used = self._used_blocks()
        kv = used / self.num_blocks if self.num_blocks else 0.0
        return len(self.running) + len(self.waiting) + kv

    @property
    def idle(self) -> bool:
        """Nothing runs, waits or is being freed here, and no load is under way."""
        busy = self.running or self.waiting or self.to_free or self._in_flight
        return not busy and not self.loading

    def status(self) -> fleet_pb2.WorkerStatus:
        out = fleet_pb2.WorkerStatus()
        out.CopyFrom(self.stats)
        out.up, out.state, out.worker_epoch, out.model = self.up, self.state, self.epoch, self.model
        out.model_name, out.loading, out.num_loads = self.model_name, self.loading, self.num_loads
        out.num_running = len(self.running) + len(self.waiting)
        out.lora_adapters.extend(sorted(self.adapters))
        out.last_error = self.last_error
        used = self._used_blocks()
        out.kv.CopyFrom(
            pb.KVUsage(
                num_blocks=self.num_blocks,
                used_blocks=used,
                free_blocks=max(self.num_blocks - used, 0),
                block_size=self.block_size,
                kv_bits=self.kv_format[0],
                kv_group_size=self.kv_format[1],
            )
        )
        return out

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def holds(self, tokens: int) -> bool:
        """Whether the worker's whole KV budget holds a request of `tokens` (unknown: yes)."""
        return not self.num_blocks or self._blocks(tokens) <= self.num_blocks

    def _used_blocks(self) -> int:
        """KV blocks the running requests hold, as far as this link knows."""
        return sum(self._blocks(r.computed) for r in self.running.values())
