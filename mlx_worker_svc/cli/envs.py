"""The environment variables the command line reads for the engine, each declared once.

As vLLM's `envs.py`: every such variable is named, typed and documented
here, and read only when asked for, so importing this module reads nothing.
The engine itself reads no variable: what it needs from one is passed in
(the embedded model's cache root), and its behaviour switches are flags
(cli/engine_flags.py). The bearer-token variables are declared beside their
flags in rpc/security.py.
"""

from __future__ import annotations

import os
from pathlib import Path

# The embedded default model's cache root: models are built in $MLX_WORKER_CACHE/models
# (unset or empty: ~/.cache/mlx-worker-svc).
MLX_WORKER_CACHE = "MLX_WORKER_CACHE"


def cache_root() -> Path | None:
    """`$MLX_WORKER_CACHE` as a path; None when unset or empty (the default root)."""
    value = os.environ.get(MLX_WORKER_CACHE, "")
    return Path(value) if value else None
