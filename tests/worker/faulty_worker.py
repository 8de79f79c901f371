"""`mlx-worker serve` whose engine thread dies after a number of Generate steps.

Usage: python tests/worker/faulty_worker.py STEPS serve ARGS... The engine-death test
runs it as a real process, to see the process itself exit.
"""

from __future__ import annotations

import sys
from typing import Any

from mlx_worker_svc.cli import main as cli
from mlx_worker_svc.engine.runner import ModelRunner


def main() -> int:
    steps = int(sys.argv[1])
    original = ModelRunner.internal_work
    calls = 0

    def failing(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > steps:
            raise RuntimeError("injected engine fault")
        return original(self, *args, **kwargs)

    ModelRunner.internal_work = failing  # type: ignore[method-assign]
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())
