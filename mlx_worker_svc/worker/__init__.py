"""The worker runtime: the lifecycle state machine, the single engine thread every MLX
call runs on, Generate scheduling and streams, and the worker's metrics.

Imports engine and core only: never grpc, protobuf or mlx (gRPC threads call in,
validate and wait; MLX is reached through the engine, on the engine thread).
"""
