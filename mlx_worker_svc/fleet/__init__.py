"""The reference fleet scheduler: drives workers through Execute, nothing else."""

from mlx_worker_svc.fleet.link import LinkConfig
from mlx_worker_svc.fleet.scheduler import (
    BadRequest,
    ContextTooLong,
    FleetConfig,
    FleetError,
    FleetScheduler,
    NoWorkers,
    OutOfVocabulary,
    Overloaded,
)

__all__ = [
    "BadRequest",
    "ContextTooLong",
    "FleetConfig",
    "FleetError",
    "FleetScheduler",
    "LinkConfig",
    "NoWorkers",
    "OutOfVocabulary",
    "Overloaded",
]
