"""The engine state every rank of a worker group holds alike, and how it is kept alike.

`Replica` owns one rank's model (its shard, in a group) and runner, and the
engine operations the worker runs on them: InitDevice, LoadModel, profiling,
the runner, WarmUp, the deep health check, Sleep and shutdown. Alone it just
runs them. On rank 0 of a group it first sends each operation to the other
ranks (group.py), and `MirroredRunner` does the same for every runner call
that changes state: a step, a Generate request added, a request freed, the
prefix cache reset or evicted. Each follower's `follow` loop applies the same
operations in the same order to its own replica, so requests, KV caches, the
prefix cache and the random state stay identical on every rank and the
model's collectives pair up; rank 0's results are the ones returned.

Operations that can fail for an expected reason (a model path missing on one
machine) gather every rank's outcome, so all ranks fail together and stay
alike. Any other failure, on any rank, breaks the group (group.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import mlx.core as mx

from mlx_worker_svc.core.domain import (
    FLOAT_KV,
    CacheConfig,
    DeviceKind,
    MemoryProfile,
    Origin,
    StepPlan,
)
from mlx_worker_svc.core.errors import Internal, WorkerError
from mlx_worker_svc.core.reports import DeviceInfo, GroupRank, LoadSpec
from mlx_worker_svc.engine.group.channel import IDLE_POLL, PING, GroupChannel, Watchdog
from mlx_worker_svc.engine.memory import device as device_mod
from mlx_worker_svc.engine.memory import profile as memory
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
from mlx_worker_svc.engine.sequence import RequestKey, Work

T = TypeVar("T")
log = logging.getLogger(__name__)

_RUNNER_CALLS = frozenset({"run", "free", "add_generate", "abort_all", "reset_prefix_cache"})
_REPLICA_CALLS = frozenset(
    {"init_device", "load", "profile", "new_runner", "warm_up", "deep_check", "release"}
    | {"evict_prefix"}
)
_LIFECYCLE = frozenset({"load", "profile", "warm_up"})


def digest(outcome: StepOutcome) -> int:
    """A checksum of a step's sampled tokens, compared across ranks."""
    crc = 0
    for (_, req_id), output in outcome.outputs.items():
        crc = zlib.crc32(f"{req_id}:{output.sampled_token_ids}".encode(), crc)
    return crc


class Replica:
    """One rank's engine state; on rank 0 of a group, the operations are sent first."""

    def __init__(self, channel: GroupChannel | None, options: EngineOptions) -> None:
        self.channel = channel or GroupChannel()
        self.options = options  # every runner's (the same on every rank)
        self.device: DeviceInfo | None = None
        self.loaded: loader.LoadedModel | None = None
        self.runner: ModelRunner | None = None
        self._closed = False

    # ------------------------------------------------- rank 0's entry points
    def _lead(self, name: str, *args: Any, **kwargs: Any) -> Any:
        channel = self.channel
        with channel.watched(name, channel.lifecycle_limit if name in _LIFECYCLE else None):
            channel.send(name, *args, **kwargs)
            return getattr(self, f"_{name}")(*args, **kwargs)

    def init_device(self, kind: DeviceKind) -> DeviceInfo:
        result: DeviceInfo = self._lead("init_device", kind)
        return result

    def load(self, spec: LoadSpec) -> loader.LoadedModel:
        result: loader.LoadedModel = self._lead("load", spec)
        return result

    def profile(self, **options: Any) -> MemoryProfile:
        """memory.profile on every rank; the suggested KV blocks fit the smallest rank."""
        result: MemoryProfile = self._lead("profile", **options)
        return result

    def new_runner(self, config: CacheConfig, profile: MemoryProfile) -> ModelRunner:
        # Unseeded sampling draws from MLX's global generator: the same seed everywhere.
        seed = secrets.randbits(32) if self.channel.grouped else None
        result: ModelRunner = self._lead("new_runner", config, profile, seed)
        return result

    def warm_up(self, batch_sizes: list[int], prefill_lengths: list[int]) -> int:
        result: int = self._lead("warm_up", batch_sizes, prefill_lengths)
        return result

    def deep_check(self) -> int:
        result: int = self._lead("deep_check")
        return result

    def release(self, *, model: bool) -> None:
        """Drops the runner (and the weights with `model`), returning memory (Sleep)."""
        self._lead("release", model=model)

    def ping(self) -> None:
        """An empty operation for an idle group (group.py); a no-op alone or closed."""
        channel = self.channel
        if channel.grouped and channel.failure is None and not self._closed:
            with channel.watched(PING):
                channel.send(PING)

    def close(self) -> None:
        """Frees everything; the followers leave their loop."""
        self._closed = True
        try:
            with self.channel.watched("close"):
                self.channel.send("close")
        finally:
            self._release(model=True)

    # ------------------------------------------------- applied on every rank
    def _together(self, fn: Callable[[], T], facts: Callable[[T], Any]) -> tuple[T, list[Any]]:
        """Runs `fn` on every rank; if it fails anywhere it raises everywhere.

        Returns this rank's result and every rank's `facts` about its own.
        """
        error: WorkerError | None = None
        try:
            result = fn()
            mine = facts(result)
        except WorkerError as exc:
            error = mine = exc
        except Exception as exc:
            log.exception("a group operation failed")
            error = mine = Internal(f"{type(exc).__name__}: {exc}")
        outcomes = self.channel.gather(mine)
        for rank, outcome in enumerate(outcomes):
            if rank == self.channel.rank and error is not None:
                raise error
            if isinstance(outcome, WorkerError):
                ranks = self.device.ranks if self.device else ()
                where = f"rank {rank} ({ranks[rank].host})" if ranks else f"rank {rank}"
                raise type(outcome)(f"on {where}: {outcome.message}")
        return result, outcomes

    def _init_device(self, kind: DeviceKind) -> DeviceInfo:
        channel = self.channel
        info, facts = self._together(
            lambda: device_mod.init_device(kind, rank=channel.rank, world_size=channel.size),
            lambda i: (
                socket.gethostname(),
                os.getpid(),
                i.name,
                i.total_memory_bytes,
                i.recommended_working_set_bytes,
            ),
        )
        ranks = []
        for rank, (host, pid, name, total, recommended) in enumerate(facts):
            local = sum(1 for other in facts[:rank] if other[0] == host)
            ranks.append(GroupRank(rank, host, local, pid, name, total, recommended))
        if channel.grouped:
            info = replace(
                info,
                local_rank=ranks[channel.rank].local_rank,
                backend=channel.backend,
                ranks=tuple(ranks),
            )
        self.device = info
        return info

    def _set_weight_bytes(self, per_rank: list[int]) -> None:
        if self.device is not None and self.device.ranks:
            ranks = tuple(
                replace(r, weight_bytes=b) for r, b in zip(self.device.ranks, per_rank, strict=True)
            )
            self.device = replace(self.device, ranks=ranks)

    def _load(self, spec: LoadSpec) -> loader.LoadedModel:
        loaded, weights = self._together(
            lambda: loader.load(spec, self.channel.mx_group), lambda m: m.info.weight_bytes
        )
        if self.runner is not None:  # the old model's: its adapter hooks point at it
            self.runner.detach()
        self.loaded, self.runner = loaded, None
        self._set_weight_bytes(weights)
        memory.release()  # the old model's buffers (a rank without a worker above it)
        return loaded

    def _model(self) -> loader.LoadedModel:
        if self.loaded is None:
            raise RuntimeError("no model is loaded on this rank")
        return self.loaded

    def _profile(self, **options: Any) -> MemoryProfile:
        loaded = self._model()
        ranks = self.device.ranks if self.device is not None else ()
        host = ranks[self.channel.rank].host if ranks else ""
        share = sum(r.host == host for r in ranks) or 1  # ranks on one machine share it
        profile: MemoryProfile
        profile, profiles = self._together(
            lambda: memory.profile(loaded.model, loaded.info, host_share=share, **options),
            lambda p: p,
        )
        return replace(profile, suggested_num_blocks=min(p.suggested_num_blocks for p in profiles))

    def _new_runner(
        self, config: CacheConfig, profile: MemoryProfile, seed: int | None
    ) -> ModelRunner:
        if seed is not None:
            mx.random.seed(seed)
        if self.runner is not None:
            self.runner.detach()
        if self.channel.leads:
            self.runner = MirroredRunner(self._model(), config, profile, self.options, self.channel)
        else:
            self.runner = ModelRunner(self._model(), config, profile, self.options)
        return self.runner

    def _warm_up(self, batch_sizes: list[int], prefill_lengths: list[int]) -> int:
        model = self._model().model
        kv = self.runner.kv if self.runner is not None else FLOAT_KV
        return self._together(
            lambda: memory.warm_up(model, batch_sizes, prefill_lengths, kv), bool
        )[0]

    def _deep_check(self) -> int:
        model = self._model().model
        return self._together(lambda: memory.deep_check(model), bool)[0]

    def _release(self, *, model: bool) -> None:
        if self.runner is not None:
            self.runner.detach()
        self.runner = None
        if model:
            self.loaded = None
            if self.device is not None:
                self._set_weight_bytes([0] * len(self.device.ranks))
        memory.release()

    def _evict_prefix(self, blocks: int) -> None:
        prefix = self.runner.state.prefix if self.runner is not None else None
        if prefix is not None:
            prefix.evict(blocks)
            mx.clear_cache()

    def apply(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A follower: applies one operation rank 0 sent."""
        if name in _RUNNER_CALLS:
            if self.runner is None:
                raise RuntimeError(f"{name}: this rank has no runner")
            result = getattr(self.runner, name)(*args, **kwargs)
            if name == "run":
                self.channel.pending_digest = digest(result)
        elif name in _REPLICA_CALLS:
            getattr(self, f"_{name}")(*args, **kwargs)
        else:
            raise ValueError(f"unknown group operation {name!r}")


class MirroredRunner(ModelRunner):
    """Rank 0's runner: each call that changes its state is applied on every rank.

    A step is sent before it runs (its forward passes are collectives); local
    changes (a request added or freed) are sent after they succeed here, so a
    refused call is never sent. Calls the runner makes to itself are not sent:
    the followers make them too.
    """

    def __init__(
        self,
        loaded: loader.LoadedModel,
        config: CacheConfig,
        profile: MemoryProfile,
        options: EngineOptions,
        channel: GroupChannel,
    ) -> None:
        super().__init__(loaded, config, profile, options)
        self._channel = channel
        self._inside = False

    @contextmanager
    def _local(self) -> Iterator[bool]:
        """Yields whether this is an outside call (to be sent); inside calls are not."""
        outside = not self._inside
        self._inside = True
        try:
            yield outside
        finally:
            if outside:
                self._inside = False

    def _send(self, name: str, *args: Any, **kwargs: Any) -> None:
        with self._channel.watched(name):
            self._channel.send(name, *args, **kwargs)

    def run(self, work: Work) -> StepOutcome:
        with self._channel.watched("a step"):
            self._channel.send("run", work)
            with self._local():
                outcome = super().run(work)
        self._channel.pending_digest = digest(outcome)
        return outcome

    def free(self, key: RequestKey, *, keep_prefix: bool = True) -> None:
        known = key in self.state.seqs
        with self._local() as outside:
            super().free(key, keep_prefix=keep_prefix)
        if outside and known:
            self._send("free", key, keep_prefix=keep_prefix)

    def add_generate(
        self,
        req_id: str,
        prompt: tuple[int, ...],
        params: Any,
        adapter: str = "",
        prompt_field: str = "prompt",
    ) -> None:
        # A group holds no adapters: one named is NOT_FOUND here, before any rank hears of it.
        super().add_generate(req_id, prompt, params, adapter, prompt_field=prompt_field)
        self._send("add_generate", req_id, prompt, params)

    def abort_all(self, origin: Origin | None = None) -> list[RequestKey]:
        with self._local() as outside:
            keys = super().abort_all(origin)
        if outside and keys:
            self._send("abort_all", origin)
        return keys

    def reset_prefix_cache(self) -> int:
        freed = super().reset_prefix_cache()
        self._send("reset_prefix_cache")
        return freed

    def plan(self, plan: StepPlan) -> Work:
        with self._evictions_sent():
            return super().plan(plan)

    def check_memory(self, work: Work, what: str) -> None:
        with self._evictions_sent():
            super().check_memory(work, what)

    @contextmanager
    def _evictions_sent(self) -> Iterator[None]:
        """Sends the prefix blocks a memory check evicted (refused or not) to every rank."""
        prefix = self.state.prefix
        before = len(prefix) if prefix is not None else 0
        try:
            yield
        finally:
            evicted = before - (len(prefix) if prefix is not None else 0)
            if evicted and not self._inside:
                self._send("evict_prefix", evicted)


def follow(channel: GroupChannel, options: EngineOptions) -> int:
    """A follower rank's life: applies rank 0's operations until it says close.

    `options` are the engine options rank 0 was started with (every rank
    gets the same command line).

    Returns the exit status: 0 when rank 0 closed the group, 1 when the group
    broke (a collective failed, or rank 0 went silent past the idle limit).
    """
    replica = Replica(channel, options)
    # The main thread may be stuck in a collective: the watchdog ends the process.
    channel.on_failure = lambda _error: _exit_soon(1)
    watchdog = Watchdog(channel)
    try:
        while True:
            with channel.watched("waiting for rank 0", channel.idle_limit):
                name, args, kwargs = channel.receive()
            if name == "close":
                replica._release(model=True)
                return 0
            if name == PING:
                time.sleep(IDLE_POLL)  # rather than wait in a collective, which spins
                continue
            limit = channel.lifecycle_limit if name in _LIFECYCLE else None
            try:
                with channel.watched(name, limit):
                    replica.apply(name, args, kwargs)
            except WorkerError as exc:
                if exc is channel.failure:
                    return 1
                # Refused on every rank alike (see Replica._together): carry on.
                log.info("%s was refused on every rank: %s", name, exc.message)
    except WorkerError:
        return 1
    finally:
        watchdog.stop()


def _exit_soon(status: int, grace: float = 2.0) -> None:
    """Ends the process after `grace` seconds unless it has ended by then."""
    timer = threading.Timer(grace, os._exit, (status,))
    timer.daemon = True
    timer.start()
