"""Shared types below every layer: domain dataclasses, the error hierarchy with its own
status `Code`, the lifecycle rules, admission limits, the log format and the
Prometheus instruments.

Every layer may import it; it imports nothing of the package outside itself, and
neither grpc, the generated protobuf nor MLX (prometheus_client is its one
third-party import).
"""
