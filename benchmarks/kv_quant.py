"""Section (j): quantized KV (`--kv-bits`) against float KV, on SmolLM2 in float16.

The model is the embedded SmolLM2 expanded to float16 (so its KV is float16,
and mlx-lm keeps the quantized KV's scales and biases in float16 too). Each
figure runs both ways side by side:

- bytes per block: DetermineMemory's own measure at float, 8 and 4 bits, the
  ratios to float, and how much its suggested num_blocks grows;
- admitted: under one memory limit (the weights plus `kv_mib` MiB), the most
  blocks InitCache accepts (its refusal names them; the call with that many
  then succeeds) and so the most requests of 2,048 tokens each;
- decode: tokens/s of a batch of `batch` requests through Execute, float
  against 8 bits: two workers side by side, warmed, then `repeats` runs of
  each interleaved, the best of each kept;
- quality: 12 chat prompts x `quality_tokens` greedy tokens, batched, at 8
  and 4 bits against float KV: the share of the answers' positions whose
  token equals the float run's, each answer as a client gets it (up to its
  EOS, at most `quality_tokens`; of two answers the longer one's positions
  count, so one that stops early or runs on differs there); the same with
  EOS ignored, all `quality_tokens` positions (past an answer's end the
  model writes on in a text it was never trained to continue, where a
  near-tie flips a token soonest), with the mean length of the identical
  prefix; and the share with the float run's tokens fed back
  (teacher-forced: at each position, is the quantized cache's greedy token
  the float run's?). A free-running token that differs changes all that
  follow.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from benchmarks.common import BLOCK_SIZE, MIB, Worker, ratio, tiny_model_module
from benchmarks.execute_client import run_execute
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

GROUP = 64
REQUEST_TOKENS = 2048
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "List two planets of the solar system.",
    "How many days are in a leap year?",
    "What does a thermometer measure?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]


def float16_copy(out_dir: Path, quantized_dir: Path) -> Path:
    """SmolLM2's weights expanded to float16: a float16 model with float16 KV."""
    import mlx.core as mx

    path: Path = tiny_model_module().dequantized_copy(quantized_dir, out_dir / "f16", mx.float16)
    return path


@contextmanager
def _server() -> Iterator[pb_grpc.WorkerServiceStub]:
    server = WorkerServer(ServerConfig(port=0, grace_seconds=5.0))
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        server.wait(30)


def _profile(stub: Any, bits: int) -> Any:
    request = pb.DetermineMemoryRequest(max_num_batched_tokens=16, block_size=BLOCK_SIZE)
    request.kv_bits, request.kv_group_size = bits, GROUP if bits else 0
    return stub.DetermineMemory(request)


def _most_blocks(stub: Any, bits: int, limit: int) -> int:
    """The most blocks InitCache takes under `limit` bytes (its refusal names them)."""
    group = GROUP if bits else 0
    request = pb.InitCacheRequest(num_blocks=1 << 30, memory_limit_bytes=limit, kv_bits=bits)
    request.kv_group_size = group
    try:
        stub.InitCache(request)
        raise RuntimeError("InitCache took 2^30 blocks")
    except grpc.RpcError as exc:
        match = re.search(r"at most (\d+) blocks fit", exc.details() or "")
        if match is None:
            raise
    fits = int(match.group(1))
    request.num_blocks = fits
    stub.InitCache(request)  # raises unless that many are taken
    return fits


def _format_figures(model: Path, kv_mib: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for bits in (0, 8, 4):
        key = str(bits)
        with _server() as stub:
            stub.InitDevice(pb.InitDeviceRequest())
            loaded = stub.LoadModel(pb.LoadModelRequest(model=str(model)))
            profile = _profile(stub, bits)
            limit = int(loaded.model.weight_bytes) + kv_mib * MIB
            blocks = _most_blocks(stub, bits, limit)
            figures[key] = {
                "bytes_per_block": int(profile.bytes_per_block),
                "suggested_num_blocks": int(profile.suggested_num_blocks),
                "memory_limit_bytes": limit,
                "most_blocks_admitted": blocks,
                "requests_of_2048_tokens": blocks * BLOCK_SIZE // REQUEST_TOKENS,
            }
    base = figures["0"]
    for key in ("8", "4"):
        f = figures[key]
        f["bytes_ratio_vs_float"] = ratio(f["bytes_per_block"], base["bytes_per_block"])
        f["suggested_blocks_ratio_vs_float"] = ratio(
            f["suggested_num_blocks"], base["suggested_num_blocks"]
        )
        f["requests_ratio_vs_float"] = ratio(
            f["requests_of_2048_tokens"], base["requests_of_2048_tokens"]
        )
    return figures


@contextmanager
def _worker(model: Path, bits: int) -> Iterator[Worker]:
    with _server() as stub:
        stub.InitDevice(pb.InitDeviceRequest())
        loaded = stub.LoadModel(pb.LoadModelRequest(model=str(model)))
        _profile(stub, bits)
        request = pb.InitCacheRequest(num_blocks=4096, block_size=BLOCK_SIZE, kv_bits=bits)
        request.kv_group_size = GROUP if bits else 0
        request.enable_prefix_caching = False
        stub.InitCache(request)
        yield Worker(stub, int(loaded.worker_epoch), loaded.model, None)


def _decode(model: Path, prompts: list[list[int]], tokens: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[Any]] = {"0": [], "8": []}
    with _worker(model, 0) as plain, _worker(model, 8) as quantized:
        workers = {"0": plain, "8": quantized}
        for worker in workers.values():
            run_execute(worker, prompts, 4)  # warm every shape
        for _ in range(repeats):
            for bits, worker in workers.items():
                runs[bits].append(run_execute(worker, prompts, tokens).timeline.stats())
    rate = {bits: max(r["decode_tok_s"] or 0.0 for r in runs[bits]) for bits in runs}
    return {
        "batch": len(prompts),
        "tokens_per_request": tokens,
        "float_decode_tok_s": rate["0"],
        "kv8_decode_tok_s": rate["8"],
        "ratio_kv8_vs_float": ratio(rate["8"], rate["0"]),
        "repeats": repeats,
        "target_ratio": 0.85,
        "runs": runs,
    }


def _quality(model: Path, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    outs: dict[int, list[list[int]]] = {}
    answers: dict[int, list[list[int]]] = {}
    until_eos = [pb.SamplingParams(temperature=0.0, max_tokens=tokens)] * len(prompts)
    for bits in (0, 8, 4):
        with _worker(model, bits) as worker:
            outs[bits] = run_execute(worker, prompts, tokens).tokens
            answers[bits] = run_execute(worker, prompts, tokens, params=until_eos).tokens
    result: dict[str, Any] = {"prompts": len(prompts), "tokens_per_prompt": tokens}
    for bits in (8, 4):
        same = total = prefix = 0
        for ours, base in zip(outs[bits], outs[0], strict=True):
            same += sum(a == b for a, b in zip(ours, base, strict=True))
            total += len(base)
            pairs = enumerate(zip(ours, base, strict=True))
            prefix += next((i for i, (a, b) in pairs if a != b), len(base))
        result[f"kv{bits}_share_equal"] = round(same / total, 4)
        result[f"kv{bits}_mean_identical_prefix"] = round(prefix / len(prompts), 2)
        result[f"kv{bits}_identical_sequences"] = _identical(outs[bits], outs[0])
        result[f"kv{bits}_teacher_forced_share_equal"] = _forced(model, prompts, outs[0], bits)
        result[f"kv{bits}_answer_share_equal"] = _answer_share(answers[bits], answers[0])
        result[f"kv{bits}_identical_answers"] = _identical(answers[bits], answers[0])
    result["answer_lengths_float"] = [len(a) for a in answers[0]]
    result["target_kv8_share_equal"] = 0.9
    return result


def _identical(ours: list[list[int]], base: list[list[int]]) -> int:
    """How many of the sequences are token for token the same."""
    return sum(a == b for a, b in zip(ours, base, strict=True))


def _answer_share(ours: list[list[int]], base: list[list[int]]) -> float:
    """Positions of the answers (up to EOS) where both have the same token.

    Each pair counts the longer answer's positions: an answer that ends
    early, or runs on, differs at every position the other has.
    """
    same = total = 0
    for a, b in zip(ours, base, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=False))  # lengths differ
        total += max(len(a), len(b))
    return round(same / total, 4)


def _forced(model_dir: Path, prompts: list[list[int]], floats: list[list[int]], bits: int) -> float:
    """Share of positions where quantized KV's greedy token is the float run's, fed its tokens.

    Each prompt is prefilled as mlx-lm's generate does (its KV then quantized),
    the rows merged into one batch cache, and every step feeds each row the
    float run's token at that position.
    """
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_worker_svc.core.domain import KVFormat
    from mlx_worker_svc.engine.cache import quantized
    from mlx_worker_svc.engine.cache.batch import merge_caches

    model, _ = load(str(model_dir))
    rows = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        rows.append(quantized.quantize(cache, KVFormat(bits, GROUP)))
    batch = merge_caches(rows)
    inputs = [p[-1] for p in prompts]
    same = total = 0
    for position in range(len(floats[0])):
        logits = model(mx.array(inputs, dtype=mx.uint32)[:, None], cache=batch)
        chosen = mx.argmax(logits[:, -1, :], axis=-1).tolist()
        wanted = [f[position] for f in floats]
        same += sum(a == b for a, b in zip(chosen, wanted, strict=True))  # type: ignore[arg-type]
        total += len(wanted)
        inputs = wanted
    return round(same / total, 4)


def section_j(
    model: Path,
    tokenizer: Any,
    *,
    batch: int,
    decode_tokens: int,
    quality_tokens: int,
    kv_mib: int,
    repeats: int = 2,
) -> dict[str, Any]:
    from benchmarks.prompts import distinct_prompts

    chats = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
            )
        )
        for q in QUESTIONS
    ]
    return {
        "model": "SmolLM2-135M-Instruct, weights expanded to float16 (float16 KV)",
        "kv_group_size": GROUP,
        "formats": _format_figures(model, kv_mib),
        "decode": _decode(model, distinct_prompts(tokenizer, batch, 8), decode_tokens, repeats),
        "quality": _quality(model, chats, quality_tokens),
    }
