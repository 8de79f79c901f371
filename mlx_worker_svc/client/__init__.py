"""Typed gRPC clients for WorkerService, asyncio and sync, with retries, deadlines,
TLS and the bearer token: what the fleet and any Python scheduler drive workers with.

Imports grpc and the generated stubs only: nothing of the worker, the engine or
MLX, so a client process stays light.
"""
