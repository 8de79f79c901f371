"""Section (h): the cost of structured outputs (SamplingParams.structured_outputs).

On the tiny model (its forward is cheap, so the grammar's share is the
largest it gets), one batch of `batch` rows decodes `tokens` tokens each:

- free: greedy, EOS ignored;
- constrained: every row under a JSON schema of its own (compact JSON), each
  schema long enough (minItems) that no row completes before `tokens`, so both
  runs generate the same token count.

Both run once untimed (warm), then `repeats` times interleaved; the best
decode tok/s of each is kept and their ratio reported (target >= 0.85), in
one-step calls and in multi-step calls (num_decode_steps = 8, where the mask
of each inner step is filled on the host between forwards). Also reported:
the host time filling masks per decode step (the worker's own counters), and
grammar compile time, cold and cached, through the worker's compiler.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Worker, ratio
from benchmarks.execute_client import run_execute
from mlx_worker_svc.core.structured_outputs import StructuredOutputs
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

_INT = {"type": "integer", "minimum": 0, "maximum": 999}
_WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}


def schemas(count: int) -> list[str]:
    """`count` JSON schemas (objects, arrays, enums, patterns) that never end early."""
    many = 1000  # minItems: far more items than any run's tokens
    shapes: list[dict[str, Any]] = [
        {"type": "array", "items": _INT, "minItems": many},
        {"type": "array", "items": _WORD, "minItems": many},
        {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": many},
        {
            "type": "array",
            "minItems": many,
            "items": {
                "type": "object",
                "properties": {"id": _INT, "name": _WORD, "ok": {"type": "boolean"}},
                "required": ["id", "name", "ok"],
                "additionalProperties": False,
            },
        },
    ]
    out = []
    for i in range(count):
        shape = shapes[i % len(shapes)]
        out.append(json.dumps({**shape, "title": f"schema {i}"}))
    return out


def _params(tokens: int, schema: str | None) -> pb.SamplingParams:
    if schema is None:
        return pb.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    spec = pb.StructuredOutputs(json_schema=schema, disable_any_whitespace=True)
    return pb.SamplingParams(temperature=0.0, max_tokens=tokens, structured_outputs=spec)


def _grammars(worker: Worker) -> Any:
    """The in-process worker's grammar compiler (its counters)."""
    assert worker.server is not None
    runner = worker.server.worker.core.runner  # the benchmark reads the worker's counters
    assert runner is not None
    return runner.grammars


def _compile_times(worker: Worker, texts: list[str]) -> dict[str, Any]:
    grammars = _grammars(worker)
    cold, cached = [], []
    for i, text in enumerate(texts):
        # A trailing space: a spec the cache has not seen (the decode runs compiled `text`).
        spec = StructuredOutputs("json_schema", text=text + " ", disable_any_whitespace=i % 2 == 0)
        start = time.perf_counter_ns()
        grammars.compile(spec, "bench")
        cold.append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        grammars.compile(spec, "bench")
        cached.append(time.perf_counter_ns() - start)
    return {
        "schemas": len(texts),
        "cold_ms_median": round(statistics.median(cold) / 1e6, 3),
        "cold_ms_max": round(max(cold) / 1e6, 3),
        "cached_ms_median": round(statistics.median(cached) / 1e6, 4),
        "tokenizer_conversion_ms": round(grammars.stats.tokenizer_ns / 1e6, 1),
    }


def _decode(
    worker: Worker, prompts: list[list[int]], params: list[pb.SamplingParams], steps: int
) -> dict[str, Any]:
    grammars = _grammars(worker)
    masks, mask_ns = grammars.stats.masks, grammars.stats.mask_ns
    run = run_execute(worker, prompts, 0, params=params, decode_steps=steps)
    stats = run.timeline.stats()
    filled = grammars.stats.masks - masks
    return {
        "decode_tok_s": stats["decode_tok_s"],
        "tokens": stats["tokens"],
        "mask_steps": filled,
        "mask_ms_per_step": round((grammars.stats.mask_ns - mask_ns) / filled / 1e6, 3)
        if filled
        else None,
    }


def section_h(
    worker: Worker, prompts: list[list[int]], tokens: int, repeats: int, model: Path
) -> dict[str, Any]:
    texts = schemas(len(prompts))
    free = [_params(tokens, None) for _ in prompts]
    constrained = [_params(tokens, s) for s in texts]
    results: dict[str, Any] = {
        "model": str(model),
        "batch": len(prompts),
        "tokens_per_request": tokens,
        "repeats": repeats,
        "target_ratio": 0.85,
    }
    for steps in (1, 8):
        _decode(worker, prompts, free, steps)  # warm both shapes and every grammar
        _decode(worker, prompts, constrained, steps)
        frees, constraineds = [], []
        for _ in range(repeats):
            frees.append(_decode(worker, prompts, free, steps))
            constraineds.append(_decode(worker, prompts, constrained, steps))
        best_free = max(frees, key=lambda r: r["decode_tok_s"] or 0)
        best_constrained = max(constraineds, key=lambda r: r["decode_tok_s"] or 0)
        assert best_free["tokens"] == best_constrained["tokens"] == tokens * len(prompts)
        results[f"decode_steps_{steps}"] = {
            "free_tok_s": best_free["decode_tok_s"],
            "constrained_tok_s": best_constrained["decode_tok_s"],
            "ratio_constrained_vs_free": ratio(
                best_constrained["decode_tok_s"], best_free["decode_tok_s"]
            ),
            "mask_ms_per_step": statistics.median(
                r["mask_ms_per_step"] for r in constraineds if r["mask_ms_per_step"] is not None
            ),
        }
    results["compile"] = _compile_times(worker, texts)
    return results
