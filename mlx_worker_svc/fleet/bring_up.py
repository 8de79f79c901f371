"""Taking a worker through its lifecycle from the fleet, as any scheduler would.

`drive_up` makes the calls a worker still needs (InitDevice, LoadModel of the
link's model, DetermineMemory at the worker's device-sized default, InitCache
at its suggested budget, WarmUp), each with the link's lifecycle deadline, and
returns the worker's GetInfo once it is READY or SERVING; one asleep is woken
(WakeUp). Asked to `swap` in
another model, it first puts the worker to sleep at level 2 (its KV and
weights freed) and loads that model in place of its own. It is called only for
a worker that is not bringing itself up (CheckHealth.bringing_up), so it never
races a worker's own start-up; a retry after a deadline joins the worker's call
in progress instead of queueing another (the proto's lifecycle rule).
`held_adapters` then reads the LoRA adapters the worker holds (fleet/adapters.py);
`load_refused` and `not_fetched` tell a LoadModel that failed the model from a worker
that went away.
"""

from __future__ import annotations

import grpc

from mlx_worker_svc.client.worker import AsyncWorkerClient, ClientError
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.fleet.step_outcome import worker_lost
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

FINAL = (pb.WORKER_STATE_READY, pb.WORKER_STATE_SERVING)
"""States in which a worker takes requests."""


def holds(info: pb.GetInfoResponse, path: str) -> bool:
    """Whether the worker's model is `path` (as LoadModel was given it, or resolved)."""
    given = {info.model.model.rstrip("/"), info.model.model_path.rstrip("/")}
    return path.rstrip("/") in given


async def drive_up(
    client: AsyncWorkerClient, config: LinkConfig, *, load: str = "", swap: str = ""
) -> pb.GetInfoResponse:
    """Brings the worker to READY/SERVING; raises ClientError, or RuntimeError naming the state.

    `load`: the model for a worker that has none (default `config.model`);
    `swap`: the model it must hold, loaded in place of the one it has.
    """
    timeout = config.lifecycle_timeout
    info = await client.get_info()
    asleep = info.state == pb.WORKER_STATE_SLEEPING
    fresh = info.state in (pb.WORKER_STATE_NEW, pb.WORKER_STATE_DEVICE_READY)
    if swap and not fresh and (asleep or not holds(info, swap)):
        if asleep or info.state in FINAL:  # its weights go first
            await client.sleep(pb.SleepRequest(level=2), timeout=timeout)
        await client.load_model(pb.LoadModelRequest(model=swap), timeout=timeout)
        info = await client.get_info()
    if info.state == pb.WORKER_STATE_SLEEPING:
        # Asleep: a swap cut short (its fleet stopped mid-load), or put to sleep by
        # another scheduler; it wakes with what it had.
        await client.wake_up(pb.WakeUpRequest(), timeout=timeout)
        info = await client.get_info()
    if info.state not in FINAL:
        if info.state == pb.WORKER_STATE_NEW:
            await client.init_device(pb.InitDeviceRequest(), timeout=timeout)
            info = await client.get_info()
        if info.state == pb.WORKER_STATE_DEVICE_READY:
            model = swap or load or config.model
            if not model:
                raise RuntimeError("the worker has no model loaded and no --model is set")
            await client.load_model(pb.LoadModelRequest(model=model), timeout=timeout)
            info = await client.get_info()
        if info.state in (pb.WORKER_STATE_MODEL_LOADED, pb.WORKER_STATE_MEMORY_PROFILED):
            # Profiled at the worker's device-sized default, as auto-init does.
            bits, group = config.kv_bits, config.kv_group_size
            profile = pb.DetermineMemoryRequest(kv_bits=bits, kv_group_size=group)
            memory = await client.determine_memory(profile, timeout=timeout)
            blocks = config.num_blocks or max(memory.suggested_num_blocks, 1)
            cache = pb.InitCacheRequest(num_blocks=blocks, kv_bits=bits, kv_group_size=group)
            await client.init_cache(cache, timeout=timeout)
            await client.warm_up(timeout=timeout)
            info = await client.get_info()
    if info.state not in FINAL:
        raise RuntimeError(f"the worker is {pb.WorkerState.Name(info.state)}")
    return info


async def held_adapters(client: AsyncWorkerClient) -> dict[str, str]:
    """The adapters a worker holds, by name, and their paths (ListLoras); none from a
    worker that predates them."""
    try:
        listing = await client.list_loras(pb.ListLorasRequest())
    except ClientError as exc:
        if exc.code is grpc.StatusCode.UNIMPLEMENTED:
            return {}
        raise
    return {adapter.name: adapter.path for adapter in listing.adapters}


def load_refused(exc: Exception) -> bool:
    """A LoadModel the worker answered with a refusal (the model, not the worker, failed)."""
    return isinstance(exc, ClientError) and exc.method == "LoadModel" and not worker_lost(exc)


class ModelNotFetched(Exception):
    """A load the worker, still up, answered UNAVAILABLE (it could not fetch the model: the
    hub out of reach): the model failed, not the worker, so its requests fail."""


def not_fetched(exc: Exception) -> bool:
    """A LoadModel answered UNAVAILABLE: the model not fetched, or the worker gone."""
    return (
        isinstance(exc, ClientError)
        and exc.method == "LoadModel"
        and exc.code is grpc.StatusCode.UNAVAILABLE
    )
