"""The inference engine, everything that touches MLX: per-request state and one step
(runner, planning, admission, prefill, recovery, sequence, sampling, text), and the
sub-packages `cache` (decode batch, prefix cache), `memory` (device, profiling,
guard, KV budget), `model` (loading, sharding, GGUF, the embedded model),
`rewrite` (bit-identical model rewrites) and `group` (worker groups).

The only package that imports `mlx` and `mlx_lm`; of the package it imports only
`core`. No grpc, no protobuf, and `mx.array` never leaves it.
"""
