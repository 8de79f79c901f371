"""Weights in: loading through mlx-lm, sharding over a worker group, GGUF conversion
(weights and tokenizer) and the embedded default model.

Imports mlx, mlx-lm and core only; the rest of the engine builds on it.
"""
