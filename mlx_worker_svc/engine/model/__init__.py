"""Weights in: loading through mlx-lm, GGUF conversion and the embedded default model."""
