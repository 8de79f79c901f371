"""The reference fleet scheduler: drives workers through Execute, nothing else."""

from mlx_worker_svc.fleet.link import LinkConfig
from mlx_worker_svc.fleet.scheduler import (
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
