"""Entry points: the `mlx-worker` command line (serve, fleet, gateway, generate,
convert-gguf), worker-group launch and the demo. May import every layer."""
