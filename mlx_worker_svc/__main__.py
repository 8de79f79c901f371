"""`python -m mlx_worker_svc` runs the `mlx-worker` command line."""

from mlx_worker_svc.cli.main import main

raise SystemExit(main())
