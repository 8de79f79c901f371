"""Taking a worker through its lifecycle from the fleet, as any scheduler would.

`drive_up` makes the calls a worker still needs (InitDevice, LoadModel of
`LinkConfig.model`, DetermineMemory at the worker's device-sized default,
InitCache at its suggested budget, WarmUp), each with the link's lifecycle
deadline, and returns the worker's GetInfo once it is READY or SERVING. It is
called only for a worker that is not bringing itself up (CheckHealth.bringing_up),
so it never races a worker's own start-up; a retry after a deadline joins the
worker's call in progress instead of queueing another (the proto's lifecycle rule).
"""

from __future__ import annotations

from mlx_worker_svc.client.worker import AsyncWorkerClient
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

FINAL = (pb.WORKER_STATE_READY, pb.WORKER_STATE_SERVING)
"""States in which a worker takes requests."""


async def drive_up(client: AsyncWorkerClient, config: LinkConfig) -> pb.GetInfoResponse:
    """Brings the worker to READY/SERVING; raises ClientError, or RuntimeError naming the state."""
    timeout = config.lifecycle_timeout
    info = await client.get_info()
    if info.state not in FINAL:
        if info.state == pb.WORKER_STATE_NEW:
            await client.init_device(pb.InitDeviceRequest(), timeout=timeout)
            info = await client.get_info()
        if info.state == pb.WORKER_STATE_DEVICE_READY:
            if not config.model:
                raise RuntimeError("the worker has no model loaded and no --model is set")
            request = pb.LoadModelRequest(model=config.model)
            await client.load_model(request, timeout=timeout)
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
