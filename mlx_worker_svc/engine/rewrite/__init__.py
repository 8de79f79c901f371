"""Model rewrites that keep tokens bit-identical: fused projections, transposed
weights, dequantized batches and the llama decode step.

Each installs itself on a loaded mlx-lm model and leaves its parameters alone.
Imports mlx and mlx-lm only (no core, no other engine part).
"""
