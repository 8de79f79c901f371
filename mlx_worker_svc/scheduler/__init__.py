"""The reference fleet scheduler: drives workers through Execute, nothing else."""

from mlx_worker_svc.scheduler.config import LinkConfig
from mlx_worker_svc.scheduler.fleet import (
    BadRequest,
    FleetConfig,
    FleetError,
    FleetScheduler,
    NoWorkers,
    Overloaded,
)

__all__ = [
    "BadRequest",
    "FleetConfig",
    "FleetError",
    "FleetScheduler",
    "LinkConfig",
    "NoWorkers",
    "Overloaded",
]
