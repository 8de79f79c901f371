"""Model rewrites that keep tokens bit-identical: fused projections, transposed
weights, dequantized batches and the llama decode step."""
