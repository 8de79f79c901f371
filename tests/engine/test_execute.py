"""Execute on the tiny model: parity with mlx-lm, batching, stopping, freeing."""

from __future__ import annotations

from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import bring_up, code_of, details_of, drive, greedy, mlx_lm_tokens
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [
    [1, 2, 3, 4, 5],
    [100, 200, 300],
    [7] * 20,
    [42],
    list(range(500, 537)),
    [9, 8, 7, 6, 5, 4, 3, 2],
    [31000, 17, 4242, 12],
    [5] * 3,
]


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    """mlx-lm's own greedy tokens for PROMPTS (ignoring EOS), 24 each."""
    return mlx_lm_tokens(tiny_dir, PROMPTS, 24)


def _ignore_eos(n: int) -> pb.SamplingParams:
    return greedy(n, ignore_eos=True)


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "batch-of-8"])
def test_greedy_parity_with_mlx_lm(
    tiny_stub: Stub, tiny_dir: Path, reference: list[list[int]], together: bool
) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    if together:
        got = drive(tiny_stub, epoch, PROMPTS, max_tokens=24, params=_ignore_eos(24))
    else:
        got = [
            drive(tiny_stub, epoch, [p], max_tokens=24, params=_ignore_eos(24))[0] for p in PROMPTS
        ]
    assert got == reference


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_prefill_gives_the_unchunked_tokens(
    tiny_stub: Stub, reference: list[list[int]], chunk: int
) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    got = drive(tiny_stub, epoch, PROMPTS[:5], max_tokens=24, chunk=chunk, params=_ignore_eos(24))
    assert got == reference[:5]


def _step(stub: Stub, epoch: int, step_id: int, **fields: object) -> pb.ExecuteResponse:
    request = pb.ExecuteRequest(step_id=step_id, worker_epoch=epoch, **fields)  # type: ignore[arg-type]
    response: pb.ExecuteResponse = stub.Execute(request)
    return response


def _decode(
    stub: Stub, epoch: int, req_id: str, computed: int, *, steps: int | None = None
) -> tuple[list[int], int, int]:
    """Decodes one request a token per step, `steps` times or until it finishes.

    Returns (tokens, num_computed_tokens, finish_reason).
    """
    tokens: list[int] = []
    reason = pb.FINISH_REASON_UNSPECIFIED
    done = 0
    while reason == pb.FINISH_REASON_UNSPECIFIED and (steps is None or done < steps):
        out = _step(
            stub,
            epoch,
            100 + done,
            cached_requests=[pb.CachedRequest(req_id=req_id, num_computed_tokens=computed)],
            num_scheduled_tokens={req_id: 1},
        ).outputs[0]
        tokens += out.sampled_token_ids
        computed, reason = out.num_computed_tokens, out.finish_reason
        done += 1
    return tokens, computed, reason


def test_stop_rules_finish_and_free(tiny_stub: Stub, reference: list[list[int]]) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    first = reference[0]
    stop_on = first[2]
    out = _step(
        tiny_stub,
        epoch,
        1,
        new_requests=[
            pb.NewRequest(req_id="len", prompt_token_ids=PROMPTS[0], sampling_params=greedy(1)),
            pb.NewRequest(
                req_id="stop",
                prompt_token_ids=PROMPTS[0],
                sampling_params=greedy(10, stop_token_ids=[stop_on]),
            ),
        ],
        num_scheduled_tokens={"len": 5, "stop": 5},
    )
    by_id = {o.req_id: o for o in out.outputs}
    assert by_id["len"].finish_reason == pb.FINISH_REASON_LENGTH
    assert list(by_id["len"].sampled_token_ids) == first[:1]
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 1  # "len" was freed at once
    rest, _, reason = _decode(tiny_stub, epoch, "stop", by_id["stop"].num_computed_tokens)
    tokens = list(by_id["stop"].sampled_token_ids) + rest
    assert reason == pb.FINISH_REASON_STOP_TOKEN and tokens == first[:3]
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 0 and health.kv.used_blocks == 0
    # The scheduler may still name requests the worker finished on its own.
    _step(tiny_stub, epoch, 50, finished_req_ids=["len", "stop"])


def test_eos_stops_unless_ignored(tiny_stub: Stub, reference: list[list[int]]) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    # Make token 2 (EOS) the greedy choice with a logit bias.
    bias = {2: 1000.0}
    eos = greedy(5, logit_bias=bias)
    ignore = greedy(3, logit_bias=bias, ignore_eos=True)
    late = greedy(5, logit_bias=bias, min_tokens=2)
    out = _step(
        tiny_stub,
        epoch,
        1,
        new_requests=[
            pb.NewRequest(req_id="eos", prompt_token_ids=[5, 6], sampling_params=eos),
            pb.NewRequest(req_id="ignore", prompt_token_ids=[5, 6], sampling_params=ignore),
            pb.NewRequest(req_id="late", prompt_token_ids=[5, 6], sampling_params=late),
        ],
        num_scheduled_tokens={"eos": 2, "ignore": 2, "late": 2},
    )
    by_id = {o.req_id: o for o in out.outputs}
    assert by_id["eos"].finish_reason == pb.FINISH_REASON_EOS
    assert list(by_id["eos"].sampled_token_ids) == [2]
    assert by_id["ignore"].finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert by_id["late"].finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert by_id["late"].sampled_token_ids[0] != 2  # EOS masked below min_tokens


def test_finished_req_ids_free_state(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    _step(
        tiny_stub,
        epoch,
        1,
        new_requests=[
            pb.NewRequest(req_id="a", prompt_token_ids=[1] * 40, sampling_params=greedy(50)),
        ],
        num_scheduled_tokens={"a": 40},
    )
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 1 and health.kv.used_blocks == 3  # 40 tokens / 16
    _step(tiny_stub, epoch, 2, finished_req_ids=["a"])
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 0 and health.kv.used_blocks == 0


def test_a_request_can_wait_unscheduled_while_others_run(
    tiny_stub: Stub, reference: list[list[int]]
) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    sampling = _ignore_eos(24)
    news = [
        pb.NewRequest(req_id=f"r{i}", prompt_token_ids=PROMPTS[i], sampling_params=sampling)
        for i in range(2)
    ]
    out = _step(tiny_stub, epoch, 1, new_requests=news, num_scheduled_tokens={"r0": 5, "r1": 3})
    tokens = {o.req_id: list(o.sampled_token_ids) for o in out.outputs}
    computed = {o.req_id: o.num_computed_tokens for o in out.outputs}
    # r1 sits out two steps (its row leaves the decode batch), then rejoins.
    for step in range(2, 40):
        ids = ["r0"] if step in (2, 3) else ["r0", "r1"]
        ids = [i for i in ids if len(tokens[i]) < 24]
        if not ids:
            break
        out = _step(
            tiny_stub,
            epoch,
            step,
            cached_requests=[
                pb.CachedRequest(req_id=i, num_computed_tokens=computed[i]) for i in ids
            ],
            num_scheduled_tokens=dict.fromkeys(ids, 1),
        )
        for o in out.outputs:
            tokens[o.req_id] += o.sampled_token_ids
            computed[o.req_id] = o.num_computed_tokens
    assert tokens["r0"] == reference[0] and tokens["r1"] == reference[1]


def test_new_token_ids_extend_the_sequence(tiny_stub: Stub, tiny_dir: Path) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    out = _step(
        tiny_stub,
        epoch,
        1,
        new_requests=[
            pb.NewRequest(req_id="a", prompt_token_ids=[1, 2, 3], sampling_params=_ignore_eos(8))
        ],
        num_scheduled_tokens={"a": 3},
    )
    first = out.outputs[0].sampled_token_ids[0]
    out = _step(
        tiny_stub,
        epoch,
        2,
        cached_requests=[
            pb.CachedRequest(req_id="a", num_computed_tokens=3, new_token_ids=[77, 78])
        ],
        num_scheduled_tokens={"a": 3},
    )
    got = out.outputs[0].sampled_token_ids[0]
    model, _ = load(str(tiny_dir))
    expected = next(iter(generate_step(mx.array([1, 2, 3, first, 77, 78]), model, max_tokens=1)))[0]
    assert got == expected and out.outputs[0].num_computed_tokens == 6


def test_preempt_and_resume_continues_identically(
    tiny_stub: Stub, reference: list[list[int]]
) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    out = _step(
        tiny_stub,
        epoch,
        1,
        new_requests=[
            pb.NewRequest(req_id="p", prompt_token_ids=PROMPTS[4], sampling_params=_ignore_eos(24))
        ],
        num_scheduled_tokens={"p": len(PROMPTS[4])},
    )
    more, _, _ = _decode(tiny_stub, epoch, "p", out.outputs[0].num_computed_tokens, steps=6)
    tokens = list(out.outputs[0].sampled_token_ids) + more
    _step(tiny_stub, epoch, 8, preempted_req_ids=["p"])
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_preempted_requests == 1 and health.kv.used_blocks == 0
    # The proto's rules: preempted again frees nothing; unknown or also finished: refused.
    _step(tiny_stub, epoch, 8, preempted_req_ids=["p"])
    for fields, code, says in (
        ({"preempted_req_ids": ["nobody"]}, "NOT_FOUND", "unknown req_id 'nobody'"),
        (
            {"preempted_req_ids": ["p"], "finished_req_ids": ["p"]},
            "INVALID_ARGUMENT",
            "req_id 'p' is both finished and preempted",
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            _step(tiny_stub, epoch, 8, **fields)
        assert (code_of(refused.value).name, says) == (code, says)
        assert says in details_of(refused.value)
    after = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert (after.num_preempted_requests, after.num_running_requests, after.kv) == (
        health.num_preempted_requests,
        health.num_running_requests,
        health.kv,
    )
    total = len(PROMPTS[4]) + len(tokens)
    out = _step(
        tiny_stub,
        epoch,
        9,
        cached_requests=[
            pb.CachedRequest(req_id="p", num_computed_tokens=0, resumed_from_preemption=True)
        ],
        num_scheduled_tokens={"p": total},
    )
    tokens += out.outputs[0].sampled_token_ids
    rest, _, reason = _decode(tiny_stub, epoch, "p", out.outputs[0].num_computed_tokens)
    assert tokens + rest == reference[4] and reason == pb.FINISH_REASON_LENGTH


def test_kv_budget_is_enforced_before_anything_changes(stub: Stub, tiny_dir: Path) -> None:
    epoch = bring_up(stub, tiny_dir, num_blocks=2)
    too_big = pb.NewRequest(req_id="big", prompt_token_ids=[1] * 33, sampling_params=greedy(4))
    with pytest.raises(grpc.RpcError) as info:
        _step(stub, epoch, 1, new_requests=[too_big], num_scheduled_tokens={"big": 33})
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV blocks" in details_of(info.value)
    assert stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
    fits = pb.NewRequest(req_id="ok", prompt_token_ids=[1] * 31, sampling_params=greedy(4))
    out = _step(stub, epoch, 2, new_requests=[fits], num_scheduled_tokens={"ok": 31})
    assert len(out.outputs[0].sampled_token_ids) == 1


def test_equally_long_prompts_prefill_together_and_give_mlx_lm_tokens(
    tiny_stub: Stub, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_worker_svc.engine import prefill
    from mlx_worker_svc.engine.cache import batch

    groups: list[int] = []

    def counted(model: object, prompts: list[list[int]], scope: object = None) -> object:
        groups.append(len(prompts))
        return batch.prefill_together(model, prompts, scope)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill, "prefill_together", counted)
    prompts = [[7 + i, 100 + i, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] for i in range(5)] + [[1, 2, 3]]
    expected = mlx_lm_tokens(tiny_dir, prompts, 12)
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    got = drive(tiny_stub, epoch, prompts, max_tokens=12, params=_ignore_eos(12))
    assert got == expected
    assert groups == [5]  # the five 12-token prompts (11 tokens before sampling) in one forward


def test_the_memory_check_counts_a_prefill_group_as_one_forward(
    tiny_stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_worker_svc.engine.memory.guard import MemoryGuard

    seen: list[list[tuple[int, int]]] = []
    estimate = MemoryGuard.estimate

    def recorded(guard: MemoryGuard, forwards: list[tuple[int, int]]) -> int:
        seen.append(list(forwards))
        return estimate(guard, forwards)

    monkeypatch.setattr(MemoryGuard, "estimate", recorded)
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    drive(tiny_stub, epoch, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2]], max_tokens=1)
    # Three 4-token prompts prefill 3 tokens each in one forward; the 2-token one alone; then
    # one decode forward of 4 rows.
    assert sorted(seen[0]) == [(1, 1), (4, 4), (9, 3)]
