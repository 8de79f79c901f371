"""The reference fleet scheduler: drives workers through Execute (and nothing else),
routes by load and prefix affinity, fails over, and serves FleetService.

Imports client, core, grpc and the generated code, and rpc's edge modules
(`status`, `metrics`, `security`); never the worker or the engine, so a fleet
process never loads MLX.
"""

from mlx_worker_svc.fleet.config import FleetConfig, LinkConfig
from mlx_worker_svc.fleet.errors import (
    BadRequest,
    ContextTooLong,
    FleetError,
    LoadFailed,
    ModelNotFound,
    NoWorkers,
    OutOfVocabulary,
    Overloaded,
    PromptTooLarge,
)
from mlx_worker_svc.fleet.models import ModelCatalog
from mlx_worker_svc.fleet.scheduler import FleetScheduler

__all__ = [
    "BadRequest",
    "ContextTooLong",
    "FleetConfig",
    "FleetError",
    "FleetScheduler",
    "LinkConfig",
    "LoadFailed",
    "ModelCatalog",
    "ModelNotFound",
    "NoWorkers",
    "OutOfVocabulary",
    "Overloaded",
    "PromptTooLarge",
]
