"""KV caches: the persistent decode batch (with its look-ahead) and the prefix cache.

Imports mlx, mlx-lm's cache classes and `engine.rewrite` (the decode step a batch
runs); nothing above the engine.
"""
