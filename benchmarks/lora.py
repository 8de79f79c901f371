"""Section (k): LoRA adapters, a different one per row, against the base model's batch.

On the tiny model, with `adapters` (4) adapters made in mlx_lm.lora's format
(tests/lora_adapters.py: random A, non-zero B, rank 8, on `keys`), one
in-process worker, warmed. Each repeat runs the base batch with no adapter
loaded (the engine as it was before adapters), loads the adapters, then runs
the other paths; each figure is the decode speed over `repeats` such
rounds (the batch over the median decode step of every run, robust to the
bursts of a shared machine; the best run's tok/s beside it), a batch of
`batch` distinct prompts, greedy, EOS ignored:

- mixed: the batch's rows spread over the adapters (2 rows each of 4), one
  forward a step, against the same batch on the base model on the same worker
  (target >= 0.7x);
- base with adapters loaded: the base batch with the adapters resident,
  against the same batch with none (target >= 0.97x);
- one adapter for every row (its own matrices, no gather), for reference;
- AddLora: the wall time of every load (read, check, stack), and its bytes.

Every path must generate `tokens` for every row, and the adapters' rows must
differ from the base rows (else the adapters would change nothing).
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.chart import Bar, Panel
from benchmarks.common import REPO, Worker, live_worker, ratio
from benchmarks.execute_client import ExecuteRun, run_execute, warm_up
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# mlx-lm's default targets: every linear layer of every block (the costliest adapter).
ALL_LINEAR = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _make_adapter() -> Any:
    """tests/lora_adapters.py's builder (the tests are not a package)."""
    path = REPO / "tests" / "lora_adapters.py"
    spec = importlib.util.spec_from_file_location("lora_adapters", path)
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/lora_adapters.py is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_adapter


def _run(worker: Worker, prompts: list[list[int]], names: list[str], tokens: int) -> ExecuteRun:
    """The prompts together through Execute, row i with adapter names[i] ("" : base)."""
    order = iter(names)

    def call(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        for new in request.new_requests:
            new.lora_name = next(order)
        response: pb.ExecuteResponse = worker.stub.Execute(request)
        return response

    run = run_execute(worker, prompts, tokens, call=call)
    got = run.timeline.total_tokens
    if got != len(prompts) * tokens:
        raise RuntimeError(f"section (k): {got} tokens, not {len(prompts) * tokens}")
    return run


def _decode_steps(run: ExecuteRun) -> list[float]:
    """Seconds between the decode steps' token arrivals (after each run's first tokens)."""
    times = [t for t, n in run.timeline.events if n > 0]
    return [(b - a) / 1e9 for a, b in itertools.pairwise(times)]


def section_k(
    model: Path,
    out_dir: Path,
    prompts: list[list[int]],
    tokens: int,
    *,
    adapters: int = 4,
    repeats: int = 7,
    keys: tuple[str, ...] = ALL_LINEAR,
) -> dict[str, Any]:
    make_adapter = _make_adapter()
    paths = {
        f"k{i}": make_adapter(out_dir / f"k{i}", model, seed=100 + i, keys=list(keys))
        for i in range(adapters)
    }
    batch = len(prompts)
    base = [""] * batch
    mixed = [f"k{i % adapters}" for i in range(batch)]
    single = ["k0"] * batch
    loads: list[float] = []
    with live_worker(model) as worker:
        warm_up(worker, [batch], [len(prompts[0])])

        def load_all() -> None:
            for name, path in paths.items():
                start = time.perf_counter()
                worker.stub.AddLora(pb.AddLoraRequest(name=name, path=str(path)))
                loads.append(time.perf_counter() - start)

        load_all()
        listed = worker.stub.ListLoras(pb.ListLorasRequest()).adapters
        for rows in (base, mixed, single):
            _run(worker, prompts, rows, 4)  # warm: every shape of the path once
        runs: dict[str, list[dict[str, Any]]] = {"today": [], "base": [], "mixed": [], "one": []}
        steps: dict[str, list[float]] = {name: [] for name in runs}
        outs: dict[str, list[list[int]]] = {}

        def measure(name: str, rows: list[str]) -> None:
            run = _run(worker, prompts, rows, tokens)
            runs[name].append(run.timeline.stats())
            steps[name] += _decode_steps(run)
            outs[name] = run.tokens

        for _ in range(repeats):
            for name in paths:  # none loaded: the engine as it was before adapters
                worker.stub.RemoveLora(pb.RemoveLoraRequest(name=name))
            measure("today", base)
            load_all()
            for name, rows in (("base", base), ("mixed", mixed), ("one", single)):
                measure(name, rows)
    # The median decode step of every run of a path: robust to a busy machine's bursts
    # (every process shares the cores), where one run's tok/s is not.
    tok_s = {name: round(batch / statistics.median(steps[name]), 3) for name in runs}
    return {
        "model": "tiny",
        "batch": batch,
        "adapters": adapters,
        "adapter_keys": list(keys),
        "adapter_rank": 8,
        "generated_tokens_per_request": tokens,
        "repeats": repeats,
        "decode_tok_s": tok_s,
        "decode_tok_s_is": "batch / the median decode step (wall) over every run of the path",
        "best_run_decode_tok_s": {
            name: max(r["decode_tok_s"] or 0 for r in runs[name]) for name in runs
        },
        "runs": runs,
        "ratio_mixed_vs_base": ratio(tok_s["mixed"], tok_s["base"]),
        "ratio_base_with_adapters_vs_none": ratio(tok_s["base"], tok_s["today"]),
        "ratio_one_adapter_vs_base": ratio(tok_s["one"], tok_s["base"]),
        "target_ratio_mixed_vs_base": 0.7,
        "target_ratio_base_with_adapters_vs_none": 0.97,
        "base_tokens_match": outs["today"] == outs["base"],
        "adapter_rows_differ_from_base": all(
            a != b for a, b in zip(outs["mixed"], outs["base"], strict=True)
        ),
        "add_lora_seconds": [round(s, 4) for s in loads],
        "add_lora_median_s": round(statistics.median(loads), 4),
        "adapter_bytes": [int(a.bytes) for a in listed],
        "adapter_load_seconds_worker": [round(a.load_seconds, 4) for a in listed],
    }


def report_rows(k: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Section (k)'s rows of the Markdown table (section, what, worker, baseline, ratio)."""
    tok_s = k["decode_tok_s"]
    b = k["batch"]

    def ratio_text(value: Any, target: float) -> str:
        return f"{value} (target >= {target})" if value is not None else "-"

    return [
        (
            f"(k) batch {b} (tiny)",
            f"decode tok/s, rows over {k['adapters']} adapters vs base rows",
            f"{tok_s['mixed']:.1f}",
            f"{tok_s['base']:.1f}",
            ratio_text(k["ratio_mixed_vs_base"], k["target_ratio_mixed_vs_base"]),
        ),
        (
            f"(k) batch {b} (tiny)",
            "decode tok/s, base rows with adapters loaded vs none loaded",
            f"{tok_s['base']:.1f}",
            f"{tok_s['today']:.1f}",
            ratio_text(
                k["ratio_base_with_adapters_vs_none"],
                k["target_ratio_base_with_adapters_vs_none"],
            ),
        ),
        (
            "(k) AddLora",
            f"seconds to load an adapter (median of {len(k['add_lora_seconds'])}), bytes each",
            f"{k['add_lora_median_s']}",
            f"{k['adapter_bytes'][0]} B",
            "",
        ),
    ]


def report_panel(k: dict[str, Any]) -> Panel:
    """Section (k)'s ratios as bars."""
    bars = [
        Bar(f"(k) {k['adapters']} adapters / base", k["ratio_mixed_vs_base"] or 0, "mixed"),
        Bar("(k) base, adapters loaded / none", k["ratio_base_with_adapters_vs_none"] or 0, ""),
        Bar("(k) one adapter / base", k["ratio_one_adapter_vs_base"] or 0, ""),
    ]
    title = f"Decode tok/s with LoRA adapters, batch {k['batch']}, tiny model"
    return Panel(
        title, bars, k["target_ratio_mixed_vs_base"], f">= {k['target_ratio_mixed_vs_base']}"
    )
