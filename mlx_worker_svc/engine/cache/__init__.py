"""KV caches: the persistent decode batch (with its look-ahead), the prefix cache, and
quantized KV (mlx-lm's quantized cache layout, per request and batched).

Imports mlx, mlx-lm's cache classes and `engine.rewrite` (the decode step a batch
runs); nothing above the engine.
"""
