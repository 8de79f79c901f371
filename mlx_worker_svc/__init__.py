"""mlx-worker-svc: a gRPC model worker for MLX."""
