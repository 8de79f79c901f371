"""Entry points: the `mlx-worker` command line (serve, convert-gguf, fleet, gateway,
generate), the worker-group launcher (`serve --world-size N`) and `make demo`.

The top layer: it parses flags and environment, builds each layer's options and
starts the servers. It may import every package; no package imports it.
"""
