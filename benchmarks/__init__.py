"""Benchmarks for the MLX worker: `python -m benchmarks.run` (see benchmarks/README.md)."""
