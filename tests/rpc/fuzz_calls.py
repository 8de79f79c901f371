"""The RPC fuzzer's calls (test_fuzz.py): one hypothesis strategy per WorkerService RPC.

A `Call` is an RPC name and its request message; `calls(paths, weights)` draws
them in given proportions (Shutdown never; Sleep only with invalid levels;
LoadModel only with junk paths or the loaded model's own spec), built from the
values of fuzz_values.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from google.protobuf.message import Message
from hypothesis import strategies as st
from rpc.fuzz_values import (
    BOOL,
    CONTEXT,
    DETOKENIZE_IDS,
    EPOCHS,
    F32,
    GENERATE_IDS,
    HUB_ID,
    LONG_TEXT,
    MAYBE_BOOL,
    MESSAGES,
    NEW_TOKEN_IDS,
    ONE_IN_SIX,
    PROMPT_IDS,
    REMOVABLE_IDS,
    REQ_IDS,
    SAMPLING,
    TEXT,
    U32,
    U64,
    huge_ids,
    pick,
    small_or_huge,
    text_values,
    weighted,
)

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


# ----------------------------------------------------------------- the calls
@dataclass(frozen=True)
class Call:
    """One RPC and its request; `epoch` picks Execute's worker_epoch at send time."""

    rpc: str
    message: Message
    epoch: str | int = "current"  # "current", "next", "previous" or a literal

    def __repr__(self) -> str:
        return f"Call({self.rpc!r}, {summary(self.message)}, epoch={self.epoch!r})"


def summary(message: Message, limit: int = 1500) -> str:
    """The request in text format, cut in the middle when long."""
    text = f"{type(message).__name__}({text_format.MessageToString(message, as_one_line=True)})"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 400]} ...[{len(text)} chars]... {text[-300:]}"


@st.composite
def new_request(draw: st.DrawFn) -> pb.NewRequest:
    request = pb.NewRequest(req_id=draw(REQ_IDS), prompt_token_ids=draw(PROMPT_IDS))
    if draw(ONE_IN_SIX) != 0:  # unset sampling_params: temperature 1, no max_tokens
        request.sampling_params.CopyFrom(draw(SAMPLING))
    return request


@st.composite
def cached_request(draw: st.DrawFn) -> pb.CachedRequest:
    return pb.CachedRequest(
        req_id=draw(REQ_IDS),
        num_computed_tokens=draw(U32),
        new_token_ids=draw(NEW_TOKEN_IDS),
        resumed_from_preemption=draw(ONE_IN_SIX) == 0,
    )


NEW_REQUESTS = st.lists(new_request(), max_size=2)
CACHED_REQUESTS = st.lists(cached_request(), max_size=2)
SCHEDULED = st.dictionaries(REQ_IDS, U32, max_size=3)
REMOVED = st.lists(REMOVABLE_IDS, max_size=2)
EPOCH = st.sampled_from(EPOCHS)
# num_decode_steps: mostly one step, often a few, sometimes at or past the limit (64).
DECODE_STEPS = weighted(
    (6, st.just(0)),
    (2, st.integers(1, 8)),
    (1, st.sampled_from((63, 64, 65, 1000, 2**32 - 1))),
)


@st.composite
def execute_call(draw: st.DrawFn) -> Call:
    new = draw(NEW_REQUESTS)
    cached = draw(CACHED_REQUESTS)
    if draw(BOOL):  # what a scheduler would schedule: often a valid step
        scheduled = {r.req_id: max(len(r.prompt_token_ids), 1) for r in new}
        scheduled.update({r.req_id: max(len(r.new_token_ids), 1) for r in cached})
    else:
        scheduled = draw(SCHEDULED)
    epoch = draw(EPOCH)
    message = pb.ExecuteRequest(
        step_id=draw(U64),
        new_requests=new,
        cached_requests=cached,
        num_scheduled_tokens=scheduled,
        finished_req_ids=draw(REMOVED),
        preempted_req_ids=draw(REMOVED),
        num_decode_steps=draw(DECODE_STEPS),
    )
    return Call("Execute", message, epoch)


GENERATE_FORMS = st.sampled_from(("prompt", "messages", "ids", "ids", "none", "two"))
GENERATE_IDS_PICK = weighted((3, st.just("")), (1, text_values(12)))
ONE_IN_TEN = st.integers(0, 9)
NEAR_CONTEXT = st.integers(CONTEXT - 7, CONTEXT - 1)
SHORT_MAX = st.integers(0, 8)


@st.composite
def generate_call(draw: st.DrawFn) -> Call:
    params = draw(SAMPLING)
    form = draw(GENERATE_FORMS)
    request = pb.GenerateRequest(request_id=draw(GENERATE_IDS_PICK), sampling_params=params)
    skip = draw(MAYBE_BOOL)
    if skip is not None:
        request.skip_special_tokens = skip
    if form in ("prompt", "two"):
        request.prompt = draw(LONG_TEXT)
    if form == "messages":
        request.messages.extend(draw(MESSAGES))
    if form in ("ids", "two"):
        request.prompt_token_ids.extend(draw(GENERATE_IDS))
    if not params.HasField("max_tokens") or params.max_tokens > 8:
        # Unbounded output costs up to a whole context of decode steps; keep it
        # cheap: either near the end of the context already, or a short cap.
        if draw(ONE_IN_TEN) == 0:
            request.prompt = ""
            del request.messages[:]
            del request.prompt_token_ids[:]
            request.prompt_token_ids.extend(huge_ids(draw(NEAR_CONTEXT), "valid"))
        else:
            request.sampling_params.max_tokens = draw(SHORT_MAX)
    return Call("Generate", request)


TOKENIZE_FORMS = st.sampled_from(("text", "text", "messages", "messages", "both", "none"))


@st.composite
def tokenize_call(draw: st.DrawFn) -> Call:
    form = draw(TOKENIZE_FORMS)
    request = pb.TokenizeRequest(add_special_tokens=draw(BOOL))
    if form in ("text", "both"):
        request.text = draw(LONG_TEXT)
    if form in ("messages", "both"):
        request.messages.extend(draw(MESSAGES))
    prompt = draw(MAYBE_BOOL)
    if prompt is not None:
        request.add_generation_prompt = prompt
    return Call("Tokenize", request)


def detokenize_call() -> st.SearchStrategy[Call]:
    return st.builds(
        lambda ids, skip: Call(
            "Detokenize", pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip)
        ),
        DETOKENIZE_IDS,
        BOOL,
    )


@dataclass(frozen=True)
class Paths:
    """What LoadModel may be pointed at: the loaded model and junk of every kind."""

    tiny: Path
    junk: tuple[str, ...]


def junk_paths(root: Path, tiny: Path) -> Paths:
    """Directories and files that look a little like a model and are not one."""
    tiny_config = (tiny / "config.json").read_text()
    layouts = {
        "empty": {},
        "bad-json": {"config.json": "{not json"},
        "no-weights": {"config.json": tiny_config},
        "unknown-type": {"config.json": '{"model_type": "no-such-architecture"}'},
        "list-config": {"config.json": "[1, 2, 3]"},
        "bad-weights": {"config.json": tiny_config, "model.safetensors": "not safetensors"},
    }
    junk = []
    for name, files in layouts.items():
        folder = root / name
        folder.mkdir()
        for filename, content in files.items():
            (folder / filename).write_text(content)
        junk.append(str(folder))
    (root / "config-is-a-dir" / "config.json").mkdir(parents=True)
    (root / "file.txt").write_text("not a model")
    junk += [
        str(root / "config-is-a-dir"),
        str(root / "file.txt"),
        str(root / "missing"),
        str(tiny / "config.json"),
        str(tiny.parent),
        "",
        ".",
        "/",
        "tests",
        "~",
        "~/no-such-model",
        "~no-such-user/model",
        "/no/such/model",
        "a" * 5000,
        "/" + "b/" * 3000,
        "\x00",
        "model\x00/x",
    ]
    return Paths(tiny=tiny, junk=tuple(junk))


def load_model_call(paths: Paths) -> st.SearchStrategy[Call]:
    junk_model = weighted(
        (3, pick(paths.junk)),
        (1, text_values(40).filter(lambda s: HUB_ID.match(s) is None)),
    )
    junk = st.builds(
        pb.LoadModelRequest,
        model=junk_model,
        adapter_path=weighted((3, st.just("")), (1, pick(paths.junk))),
        max_model_len=U32,
        revision=weighted((3, st.just("")), (1, text_values(12))),
        trust_remote_code=BOOL,
    )
    # The loaded model itself: the same spec (a no-op), or with an adapter that
    # is not one. Any other change to its spec would load it again (a new epoch).
    same = st.builds(
        pb.LoadModelRequest,
        model=st.just(str(paths.tiny)),
        adapter_path=weighted((1, st.just("")), (2, pick(paths.junk))),
    )
    return weighted((6, junk), (1, same)).map(lambda m: Call("LoadModel", m))


def lifecycle_calls(paths: Paths) -> dict[str, st.SearchStrategy[Call]]:
    device = st.builds(
        pb.InitDeviceRequest,
        device=st.sampled_from((0, 0, 1, 2, 3, 7, -1, 2**31 - 1)),
        rank=weighted((3, st.just(0)), (1, U32)),
        local_rank=weighted((3, st.just(0)), (1, U32)),
        world_size=weighted((3, st.sampled_from((0, 1))), (1, U32)),
        distributed_init_method=weighted((3, st.just("")), (1, TEXT)),
    )
    memory = st.builds(
        pb.DetermineMemoryRequest,
        memory_utilization=F32,
        max_num_batched_tokens=U32,
        block_size=small_or_huge(64, (0, 1, 15, 16, 17, 32, 511, 512, 2**31, 2**32 - 1)),
    )
    cache = st.builds(
        pb.InitCacheRequest,
        num_blocks=U64,
        block_size=U32,
        enable_prefix_caching=MAYBE_BOOL,
        memory_limit_bytes=weighted((2, st.just(0)), (1, U64)),
    )
    warm_up = st.builds(
        pb.WarmUpRequest,
        batch_sizes=st.lists(small_or_huge(4, (0, 1, 2, 8, 2**31, 2**32 - 1)), max_size=2),
        # A valid prefill near the context takes seconds here (CONTEXT itself is
        # an explicit example); just past it must be refused.
        prefill_lengths=st.lists(small_or_huge(16, (0, 1, 16, CONTEXT + 1, 2**32 - 1)), max_size=2),
    )
    return {
        "InitDevice": device.map(lambda m: Call("InitDevice", m)),
        "LoadModel": load_model_call(paths),
        "DetermineMemory": memory.map(lambda m: Call("DetermineMemory", m)),
        "InitCache": cache.map(lambda m: Call("InitCache", m)),
        "WarmUp": warm_up.map(lambda m: Call("WarmUp", m)),
    }


def other_calls() -> dict[str, st.SearchStrategy[Call]]:
    return {
        "Execute": execute_call(),
        "Generate": generate_call(),
        "Tokenize": tokenize_call(),
        "Detokenize": detokenize_call(),
        "GetInfo": st.just(Call("GetInfo", pb.GetInfoRequest())),
        "CheckHealth": st.builds(
            lambda deep: Call("CheckHealth", pb.CheckHealthRequest(deep=deep)), BOOL
        ),
        # Only invalid levels: a valid Sleep would abort the keepers (new epoch).
        "Sleep": st.builds(
            lambda level: Call("Sleep", pb.SleepRequest(level=level)),
            weighted(
                (2, st.sampled_from((3, 4, 2**31, 2**32 - 1))), (1, st.integers(3, 2**32 - 1))
            ),
        ),
        "WakeUp": st.just(Call("WakeUp", pb.WakeUpRequest())),
        "ResetPrefixCache": st.just(Call("ResetPrefixCache", pb.ResetPrefixCacheRequest())),
        "AddLora": st.builds(
            lambda name, path: Call("AddLora", pb.AddLoraRequest(name=name, path=path)),
            TEXT,
            TEXT,
        ),
        "RemoveLora": st.builds(
            lambda name: Call("RemoveLora", pb.RemoveLoraRequest(name=name)), TEXT
        ),
        "PinLora": st.builds(
            lambda name, unpin: Call("PinLora", pb.PinLoraRequest(name=name, unpin=unpin)),
            TEXT,
            st.booleans(),
        ),
        "ListLoras": st.just(Call("ListLoras", pb.ListLorasRequest())),
    }


def calls(paths: Paths, weights: dict[str, int]) -> st.SearchStrategy[Call]:
    strategies = {**lifecycle_calls(paths), **other_calls()}
    assert set(weights) == set(strategies)
    return weighted(*((weights[name], strategies[name]) for name in sorted(weights)))
