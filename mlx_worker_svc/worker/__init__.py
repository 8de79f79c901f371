"""The worker runtime: the lifecycle state machine, the single engine thread, Generate
scheduling and the worker's metrics. Imports engine and core, never gRPC or protobuf."""
