"""An OpenAI- and Anthropic-compatible HTTP gateway over an in-process fleet scheduler
(`mlx-worker gateway`): routes, request validation, responses, API keys, metrics.

Imports fleet, client, core, the generated code and rpc's `security` and `status`;
never the worker or the engine.
"""

from mlx_worker_svc.gateway.app import GatewayConfig, create_app
from mlx_worker_svc.gateway.serve import GatewayServer

__all__ = ["GatewayConfig", "GatewayServer", "create_app"]
