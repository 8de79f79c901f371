"""`serve --kv-bits/--kv-group-size`: bad values exit 2 at once; good ones reach auto-init."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from driver import ServeProcess
from tiny_model import build_tiny_model

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--kv-bits", "7"], "--kv-bits 7 is not a width MLX quantizes to: use one of 2, 3, 4"),
        (["--kv-bits", "16"], "--kv-bits 16 is not a width MLX quantizes to"),
        (["--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size 48: use one of 32, 64"),
        (["--kv-group-size", "32"], "--kv-group-size 32 needs --kv-bits"),
        (["--kv-group-size", "64"], "--kv-group-size 64 needs --kv-bits"),  # the default too
    ],
)
def test_bad_kv_flags_exit_2_with_one_line(tiny_dir: Path, flags: list[str], says: str) -> None:
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--auto-init"]
    command += ["--model", str(tiny_dir), "--port", "0", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stdout == ""  # nothing started
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-worker serve: ") and says in lines[0]


def test_auto_init_brings_up_quantized_kv(
    tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path
) -> None:
    model = build_tiny_model(tmp_path_factory.mktemp("kv") / "model", smollm_dir, head_dim=64)
    worker = ServeProcess(model, 5.0, ["--kv-bits", "4", "--kv-group-size", "32"])
    try:
        stub = pb_grpc.WorkerServiceStub(worker.channel())  # type: ignore[no-untyped-call]
        kv = stub.GetInfo(pb.GetInfoRequest(), timeout=30).kv
        assert (kv.kv_bits, kv.kv_group_size) == (4, 32)
        reply = stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3],
                sampling_params=pb.SamplingParams(max_tokens=4, ignore_eos=True),
            ),
            timeout=60,
        )
        assert sum(len(r.token_ids) for r in reply) == 4
    finally:
        worker.reap()


def test_fleet_refuses_a_bad_kv_width_before_any_worker_is_contacted() -> None:
    command = [sys.executable, "-m", "mlx_worker_svc", "fleet", "--worker", "127.0.0.1:9"]
    command += ["--port", "0", "--kv-bits", "7"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-worker fleet: --kv-bits 7 is not a width")
