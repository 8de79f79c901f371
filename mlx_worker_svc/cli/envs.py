"""The environment variables the command line reads for the engine, each declared once.

As vLLM's `envs.py`: every such variable is named, typed and documented
here, and read only when asked for, so importing this module reads nothing.
The engine itself reads no variable: what it needs from one is passed in
(the embedded model's cache root), and its behaviour switches are flags
(cli/engine_flags.py). The bearer-token variables are read by the security
flags (security_flags.py) through `rpc.security.load_tokens`.
"""

from __future__ import annotations

import os
from pathlib import Path

# The embedded default model's cache root: models are built in $MLX_WORKER_CACHE/models
# (unset or empty: ~/.cache/mlx-worker-svc).
MLX_WORKER_CACHE = "MLX_WORKER_CACHE"


# A server's bearer token (`serve`, `fleet`), added to any --token-file tokens.
MLX_WORKER_TOKEN = "MLX_WORKER_TOKEN"
# The bearer token the fleet, the gateway and `generate` send to the workers.
MLX_WORKER_CLIENT_TOKEN = "MLX_WORKER_CLIENT_TOKEN"
# An API key the gateway accepts, added to any --api-key-file keys.
MLX_GATEWAY_API_KEY = "MLX_GATEWAY_API_KEY"


def cache_root() -> Path | None:
    """`$MLX_WORKER_CACHE` as a path; None when unset or empty (the default root)."""
    value = os.environ.get(MLX_WORKER_CACHE, "")
    return Path(value) if value else None
