"""Memory: device facts, the activation and KV-block profiles, the memory guard that
refuses a step before it runs out, and the KV budget InitCache sets.

Imports mlx, core, `engine.cache` and `engine.rewrite` (to profile the shapes the
runner will use).
"""
