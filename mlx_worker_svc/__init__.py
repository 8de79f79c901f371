"""mlx-worker-svc: a gRPC model worker for MLX that a remote scheduler drives step by step.

The root holds only packages, one per layer (imports point down; `make lint`
checks it with the import contracts in pyproject.toml): `cli` on top; the worker
process's stack `rpc` > `worker` > `engine` > `core`; the fleet's stack `gateway` >
`fleet` > `client` > `core`; and `gen`, the generated protobuf code.
"""
