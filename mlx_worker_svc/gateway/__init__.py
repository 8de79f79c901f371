"""An OpenAI-compatible HTTP gateway over the fleet scheduler (`mlx-worker gateway`)."""

from mlx_worker_svc.gateway.app import GatewayConfig, create_app
from mlx_worker_svc.gateway.serve import GatewayServer

__all__ = ["GatewayConfig", "GatewayServer", "create_app"]
