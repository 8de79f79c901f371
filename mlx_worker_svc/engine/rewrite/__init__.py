"""Model rewrites that keep tokens bit-identical: fused projections, transposed
weights, dequantized batches, the llama decode step, and gemma2's batch masks (which
make its batched tokens right).

Each installs itself on a loaded mlx-lm model and leaves its parameters alone.
Imports mlx and mlx-lm only (no core, no other engine part).
"""
