"""The inference engine: model loading, conversion and execution on MLX."""
