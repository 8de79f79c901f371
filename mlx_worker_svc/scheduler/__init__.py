"""The reference fleet scheduler: drives workers through Execute, nothing else."""

from mlx_worker_svc.scheduler.fleet import (
    BadRequest,
    ContextTooLong,
    FleetConfig,
    FleetError,
    FleetScheduler,
    NoWorkers,
    Overloaded,
)
from mlx_worker_svc.scheduler.link import LinkConfig

__all__ = [
    "BadRequest",
    "ContextTooLong",
    "FleetConfig",
    "FleetError",
    "FleetScheduler",
    "LinkConfig",
    "NoWorkers",
    "Overloaded",
]
