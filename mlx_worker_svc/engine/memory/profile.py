"""Measuring memory: activation peak, bytes per KV block, warm-up shapes.

Every figure comes from running the loaded model, not from a formula: the
activation peak from a profiling forward at the step's token budget, and the
bytes of one KV block from a real cache filled with one block of tokens (in
the KV format asked for: quantized KV is measured from mlx-lm's quantized
cache, its scales and biases included).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_worker_svc.core.domain import FLOAT_KV, KVFormat, MemoryProfile
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.reports import ModelInfo
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import merge_caches
from mlx_worker_svc.engine.memory import guard
from mlx_worker_svc.engine.memory.device import memory_facts
from mlx_worker_svc.engine.rewrite import dequant


def _filled_bytes(cache: list[Any]) -> int:
    """Bytes of the KV actually held (a cache's buffers grow in steps)."""
    total = 0
    for layer in cache:
        offset = getattr(layer, "offset", None)
        for _, array in tree_flatten(layer.state):
            if not isinstance(array, mx.array):
                continue
            if isinstance(offset, int) and array.ndim == 4 and array.shape[2] >= offset:
                total += int(array[..., :offset, :].nbytes)
            else:
                total += int(array.nbytes)
    return total


def bytes_per_block(
    model: nn.Module, block_size: int, kv: KVFormat = FLOAT_KV, where: str = "DetermineMemory"
) -> int:
    """Bytes one block of `block_size` tokens takes in this model's KV cache, stored as `kv`.

    Raises InvalidArgument (naming `where`'s fields) if the model cannot store `kv`.
    """
    cache = make_prompt_cache(model)
    model(mx.zeros((1, block_size), dtype=mx.uint32), cache=cache)
    if kv.quantized:
        if not quantized.supported(cache):
            raise InvalidArgument(
                f"{where}.kv_bits {kv.bits}: quantized KV needs a model whose every layer "
                "keeps a plain KV cache (this one has sliding-window or recurrent layers)"
            )
        quantized.check_head_dims(kv, quantized.head_dims(cache), where)
        _check_quantized_attention(model, kv, where)
        cache = quantized.quantize(cache, kv)
    mx.eval([c.state for c in cache])
    return _filled_bytes(cache)


def _check_quantized_attention(model: nn.Module, kv: KVFormat, where: str) -> None:
    """Raises InvalidArgument if the model's attention does not run on a quantized cache
    (mlx-lm's gemma2 expands its keys as arrays, which quantized keys are not)."""
    try:
        mx.eval(model(mx.zeros((1, 1), dtype=mx.uint32), cache=quantized.empty(model, kv)))
    except (TypeError, ValueError, AttributeError) as exc:
        said = str(exc).strip().splitlines()[0].split(". ")[0].rstrip(".:") if str(exc) else ""
        raise InvalidArgument(
            f"{where}.kv_bits {kv.bits}: this model's attention ({type(model).__module__}) "
            f"does not run on a quantized KV cache ({type(exc).__name__}: {said}); leave "
            "kv_bits 0"
        ) from None


def _forward_peak(model: nn.Module, tokens: int, kv: KVFormat = FLOAT_KV) -> int:
    """Bytes a fresh forward of `tokens` tokens allocates above what is live.

    With quantized KV the forward attends through a quantized cache from its
    first token, as every chunk after a prompt's first does: mlx-lm's quantized
    attention holds the whole score matrix, which MLX's fused float attention
    never does, so this is the larger peak of the two.
    """
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    guard.reset_peak()
    cache = quantized.empty(model, kv)
    logits = model(mx.zeros((1, tokens), dtype=mx.uint32), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    peak = mx.get_peak_memory()
    del logits, cache
    mx.clear_cache()
    return max(int(peak) - int(before), 0)


def fit_activations(points: list[tuple[int, int]]) -> tuple[float, float, float]:
    """(fixed, per token, per token pair) from forwards (T tokens, peak bytes).

    A forward of c tokens over a context of L peaks at about
    fixed + per_token * c + per_pair * c * L; the profile runs c = L = T at
    three sizes and solves for the three terms, none below zero.
    """
    (t1, p1), (t2, p2), (t3, p3) = sorted(points, reverse=True)
    if len({t1, t2, t3}) < 3:
        return 0.0, p1 / max(t1, 1), 0.0
    matrix = mx.array([[1.0, t, t * t] for t in (t1, t2, t3)], dtype=mx.float32)
    rhs = mx.array([float(p1), float(p2), float(p3)], dtype=mx.float32)
    fixed, per_token, per_pair = (float(v) for v in mx.linalg.solve(matrix, rhs, stream=mx.cpu))
    if per_pair < 0 or per_token < 0 or fixed < 0:
        # Noise in a small profile: fall back to the conservative linear bound.
        return 0.0, p1 / t1, 0.0
    return fixed, per_token, per_pair


def profile(
    model: nn.Module,
    info: ModelInfo,
    *,
    memory_utilization: float,
    max_num_batched_tokens: int,
    block_size: int,
    kv: KVFormat = FLOAT_KV,
    adapter_bytes: int = 0,
    host_share: int = 1,
) -> MemoryProfile:
    """Profiles forwards up to `max_num_batched_tokens` and sizes the KV budget for `kv`.

    `adapter_bytes` (resident LoRA adapters) count with the weights. `host_share`: the
    processes of a worker group on this machine, which share its memory: each counts
    that share of the working set it may use.
    """
    per_block = bytes_per_block(model, block_size, kv)  # first: it checks `kv`
    sizes = sorted(
        {
            max_num_batched_tokens,
            max(max_num_batched_tokens // 2, 1),
            max(max_num_batched_tokens // 4, 1),
        },
        reverse=True,
    )
    points = [(size, _forward_peak(model, size, kv)) for size in sizes]
    activation = points[0][1]
    fixed, per_token, per_pair = (
        fit_activations(points)
        if len(points) == 3
        else (0.0, activation / max_num_batched_tokens, 0.0)
    )
    total, recommended = memory_facts()
    allowed = int(recommended * memory_utilization) // max(host_share, 1)
    weights = info.weight_bytes + adapter_bytes
    available = max(allowed - weights - activation, 0)
    return MemoryProfile(
        total_memory_bytes=total,
        recommended_working_set_bytes=recommended,
        weight_bytes=weights,
        activation_peak_bytes=activation,
        available_kv_bytes=available,
        bytes_per_block=per_block,
        block_size=block_size,
        suggested_num_blocks=available // per_block if per_block else 0,
        memory_utilization=memory_utilization,
        activation_bytes_fixed=fixed,
        activation_bytes_per_token=per_token,
        activation_bytes_per_token_pair=per_pair,
        kv=kv,
        adapter_bytes=adapter_bytes,
    )


def warm_up(
    model: nn.Module, batch_sizes: list[int], prefill_lengths: list[int], kv: KVFormat = FLOAT_KV
) -> int:
    """Runs each prefill length and decode batch size once, KV stored as `kv`; shapes run."""
    shapes = 0
    for length in prefill_lengths:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((1, length), dtype=mx.uint32), cache=cache))
        shapes += 1
    for size in batch_sizes:
        caches = []
        for _ in range(size):
            cache = make_prompt_cache(model)
            model(mx.zeros((1, 1), dtype=mx.uint32), cache=cache)
            # One forward per evaluation: in a pipeline group two pending forwards
            # could run their sends and receives in different orders on two ranks.
            cache = quantized.quantize(cache, kv)
            mx.eval([c.state for c in cache])
            caches.append(cache)
        batch = merge_caches(caches)
        with dequant.rows(model, size):
            mx.eval(model(mx.zeros((size, 1), dtype=mx.uint32), cache=batch))
        shapes += 1
    mx.clear_cache()
    return shapes


def deep_check(model: nn.Module) -> int:
    """A 1-token forward; returns its duration in ns (raises if the engine fails)."""
    start = time.perf_counter_ns()
    logits = model(mx.zeros((1, 1), dtype=mx.uint32))
    mx.eval(logits)
    if not bool(mx.all(mx.isfinite(logits)).item()):
        raise RuntimeError("deep check: the model produced non-finite logits")
    return time.perf_counter_ns() - start


def release() -> None:
    """Returns MLX's cached buffers to the system (after freeing model or KV)."""
    import gc

    gc.collect()
    mx.clear_cache()
