"""LoRA adapters beside the base weights: read and checked (files.py), resident
with an LRU cap and pins (registry.py), applied per row inside one batched
forward (forward.py).

Imports mlx, mlx-lm, core and engine/rewrite (whose layers it recognises); the
rest of the engine imports it.
"""
