"""Generate streams on the tiny model: tokens, text, stopping, concurrency."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import bring_up, code_of, details_of, drive, greedy, mlx_lm_tokens
from mlx_lm import load
from mlx_lm.generate import generate_step, stream_generate

from mlx_worker_svc.engine.runner import StepOutcome
from mlx_worker_svc.engine.sequence import Work
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub


def _collect(stub: Stub, request: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateResponse]:
    tokens: list[int] = []
    text = ""
    last = None
    for message in stub.Generate(request):
        tokens += message.token_ids
        text += message.text
        last = message
    assert last is not None
    return tokens, text, last


def test_generate_streams_mlx_lm_greedy_tokens(tiny_stub: Stub, tiny_dir: Path) -> None:
    prompt = [1, 2, 3, 4, 5]
    tokens, text, last = _collect(
        tiny_stub,
        pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=greedy(12, ignore_eos=True)),
    )
    model, tokenizer = load(str(tiny_dir))
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=12)]
    assert tokens == expected
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.prompt_tokens, last.completion_tokens) == (5, 12)
    assert last.request_id


def test_model_names_the_loaded_model_however_its_path_is_written(
    tiny_stub: Stub, tiny_dir: Path
) -> None:
    # The tiny model was loaded as str(tiny_dir): LoadModel takes these forms as the same.
    relative = os.path.relpath(tiny_dir)
    for name in (str(tiny_dir), f"{tiny_dir}/", tiny_dir.name, relative, f"./{relative}/"):
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], model=name, sampling_params=greedy(2))
        assert len(_collect(tiny_stub, request)[0]) == 2, name
    request = pb.GenerateRequest(prompt_token_ids=[1, 2], model=f"{tiny_dir}-other")
    with pytest.raises(grpc.RpcError) as refused:
        _collect(tiny_stub, request)
    assert code_of(refused.value) == grpc.StatusCode.NOT_FOUND
    assert details_of(refused.value).startswith("model: this worker does not serve")


@pytest.mark.parametrize("skip", [None, True, False])
def test_generate_text_leaves_every_special_token_out_unless_asked(
    tiny_stub: Stub, skip: bool | None
) -> None:
    """skip_special_tokens (default true) leaves out chat markers too, not only EOS."""
    start, end, text_id = 1, 2, 28  # <|im_start|>, <|im_end|> (EOS), a plain token
    # Greedy, the penalty taking turns: the marker, the plain token, the marker again.
    bias = {start: 100.0, text_id: 99.0}
    request = pb.GenerateRequest(
        prompt_token_ids=[5, 6, 7],
        sampling_params=greedy(4, ignore_eos=True, logit_bias=bias, repetition_penalty=4.0),
    )
    if skip is not None:
        request.skip_special_tokens = skip
    tokens, text, _ = _collect(tiny_stub, request)
    assert start in tokens and text_id in tokens and end not in tokens
    words = tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens, skip_special_tokens=True))
    whole = tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens))
    assert "<|im_start|>" in whole.text
    assert text == (whole.text if skip is False else words.text)


def test_generate_chat_and_text_prompts(tiny_stub: Stub) -> None:
    chat = [pb.ChatMessage(role="user", content="Hello there")]
    rendered = tiny_stub.Tokenize(pb.TokenizeRequest(messages=chat))
    assert "<|im_start|>assistant" in rendered.text
    tokens, _, last = _collect(
        tiny_stub, pb.GenerateRequest(messages=chat, sampling_params=greedy(4, ignore_eos=True))
    )
    assert last.prompt_tokens == len(rendered.token_ids) and len(tokens) == 4
    plain = tiny_stub.Tokenize(pb.TokenizeRequest(text="Hello there"))
    assert plain.token_ids and not plain.text  # the text is not echoed back
    _, _, last = _collect(
        tiny_stub, pb.GenerateRequest(prompt="Hello there", sampling_params=greedy(2))
    )
    assert last.prompt_tokens == len(plain.token_ids)
    text = tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=plain.token_ids)).text
    assert text == "Hello there"


def test_concurrent_generate_calls_and_execute_share_the_engine(
    tiny_stub: Stub, tiny_dir: Path
) -> None:
    prompts = [[1, 2, 3], [10, 20, 30, 40], [7, 7], [300, 301, 302, 303, 304]]
    expected = mlx_lm_tokens(tiny_dir, prompts, 16)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        tokens, _, _ = _collect(
            tiny_stub,
            pb.GenerateRequest(
                prompt_token_ids=prompts[i], sampling_params=greedy(16, ignore_eos=True)
            ),
        )
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # An Execute-driven request with the same id space as nothing else runs meanwhile.
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    executed = drive(
        tiny_stub, epoch, [prompts[3]], max_tokens=16, params=greedy(16, ignore_eos=True)
    )
    for t in threads:
        t.join(timeout=120)
    assert [results[i] for i in range(3)] == expected[:3]
    assert executed == [expected[3]]
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 0 and health.kv.used_blocks == 0


def test_cancelled_generate_frees_its_request(
    tiny_stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_worker_svc.worker.generation")
    stream = tiny_stub.Generate(
        pb.GenerateRequest(
            request_id="left",
            prompt_token_ids=[1, 2],
            sampling_params=greedy(400, ignore_eos=True),
        )
    )
    first = next(stream)
    assert first.token_ids
    stream.cancel()
    for _ in range(200):
        if tiny_stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0:
            break
        threading.Event().wait(0.05)
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
    # Logged as the caller's cancel (operations.md's log lines), not as an abort.
    ends = [
        r
        for r in caplog.records
        if getattr(r, "req_id", "") == "left" and r.msg != "request admitted"
    ]
    assert [r.getMessage() for r in ends] == ["request cancelled"]


def test_a_failing_generate_step_ends_its_stream_and_the_worker_serves_on(
    tiny_stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_worker_svc.engine.runner import ModelRunner

    real_run = ModelRunner.run
    calls = {"n": 0}

    def flaky(self: ModelRunner, work: Work) -> StepOutcome:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated MLX failure")
        return real_run(self, work)

    monkeypatch.setattr(ModelRunner, "run", flaky)
    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(4))
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.Generate(request))
    assert code_of(info.value) == grpc.StatusCode.INTERNAL
    assert "simulated MLX failure" in details_of(info.value)
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.healthy and health.num_running_requests == 0
    assert "simulated MLX failure" in health.last_error
    tokens, _, last = _collect(tiny_stub, request)
    assert len(tokens) == 4 and last.finish_reason == pb.FINISH_REASON_LENGTH


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_tools_and_tool_messages_reach_the_chat_template(stub: Stub, tiny_tools_dir: Path) -> None:
    bring_up(stub, tiny_tools_dir)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    chat = [
        pb.ChatMessage(role="user", content="The time?"),
        pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([call])),
        pb.ChatMessage(role="tool", content="12:00", tool_call_id="c1", name="get_time"),
    ]
    rendered = stub.Tokenize(pb.TokenizeRequest(messages=chat, tools_json=json.dumps(TOOLS)))
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in rendered.text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in rendered.text
    assert "<tool_response>\n12:00\n</tool_response>" in rendered.text
    request = pb.GenerateRequest(
        messages=chat, tools_json=json.dumps(TOOLS), sampling_params=greedy(2, ignore_eos=True)
    )
    assert _collect(stub, request)[2].prompt_tokens == len(rendered.token_ids)
    bad = [
        (pb.TokenizeRequest(messages=chat, tools_json="{"), "tools_json: not JSON"),
        (
            pb.TokenizeRequest(messages=chat, tools_json='{"a": 1}'),
            "tools_json: expected a JSON array of objects",
        ),
        (
            pb.TokenizeRequest(messages=[pb.ChatMessage(role="assistant", tool_calls_json="[1]")]),
            "messages[0].tool_calls_json: expected a JSON array of objects",
        ),
        (
            pb.TokenizeRequest(text="hi", tools_json=json.dumps(TOOLS)),
            "tools_json needs messages",
        ),
        (  # a template reads tool_calls on assistant messages only: dropped elsewhere
            pb.TokenizeRequest(
                messages=[pb.ChatMessage(role="user", tool_calls_json=json.dumps([call]))]
            ),
            "messages[0].tool_calls_json: only an assistant message makes tool calls",
        ),
        (  # the template's own error ("'dict object' has no attribute 'function'") before
            pb.TokenizeRequest(
                messages=[pb.ChatMessage(role="assistant", tool_calls_json='[{"id": "a"}]')]
            ),
            "messages[0].tool_calls_json[0].function.name: a call needs its function's name",
        ),
        (
            pb.TokenizeRequest(
                messages=[
                    pb.ChatMessage(
                        role="assistant",
                        tool_calls_json='[{"function": {"name": "", "arguments": {}}}]',
                    )
                ]
            ),
            "messages[0].tool_calls_json[0].function.name: a call needs its function's name",
        ),
        (
            pb.TokenizeRequest(messages=chat, tools_json='[{"a": NaN}]'),
            "tools_json: not JSON (NaN is not a JSON value)",
        ),
        (
            pb.TokenizeRequest(text="hi", add_generation_prompt=True),
            "add_generation_prompt needs messages",
        ),
        (
            pb.TokenizeRequest(messages=chat, add_special_tokens=True),
            "add_special_tokens is for text",
        ),
    ]
    for ask, message in bad:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Tokenize(ask)
        assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(caught.value).startswith(message)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(pb.GenerateRequest(prompt="hi", tools_json=json.dumps(TOOLS))))
    assert details_of(caught.value).startswith("tools_json needs messages")


def _both_refuse(
    stub: Stub, chat: list[pb.ChatMessage], code: grpc.StatusCode, starts: str, tools: str = ""
) -> None:
    """Tokenize and Generate of `chat` (and `tools`) both fail with `code`, saying `starts`."""
    for call in (
        lambda: stub.Tokenize(pb.TokenizeRequest(messages=chat, tools_json=tools)),
        lambda: list(stub.Generate(pb.GenerateRequest(messages=chat, tools_json=tools))),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert code_of(caught.value) == code
        assert details_of(caught.value).startswith(starts)


def test_a_template_without_tools_refuses_them(tiny_stub: Stub) -> None:
    chat = [pb.ChatMessage(role="user", content="The time?")]
    _both_refuse(
        tiny_stub,
        chat,
        grpc.StatusCode.INVALID_ARGUMENT,
        "tools_json: the model's chat template does not render tools (it never reads `tools`)",
        tools=json.dumps(TOOLS),
    )
    # An empty array offers no tools: the same prompt as none.
    none = tiny_stub.Tokenize(pb.TokenizeRequest(messages=chat)).token_ids
    empty = tiny_stub.Tokenize(pb.TokenizeRequest(messages=chat, tools_json="[]")).token_ids
    assert list(empty) == list(none)


def test_a_template_without_tool_calls_refuses_a_history_with_them(tiny_stub: Stub) -> None:
    """The model would see the chat without the calls: refused, never dropped."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]
    chat = [
        pb.ChatMessage(role="user", content="The time?"),
        pb.ChatMessage(role="assistant", tool_calls_json=json.dumps(calls)),
        pb.ChatMessage(role="tool", content="12:00", tool_call_id="c1"),
    ]
    _both_refuse(
        tiny_stub,
        chat,
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[1].tool_calls_json: the model's chat template does not render tool calls",
    )
    assert tiny_stub.Tokenize(pb.TokenizeRequest(messages=chat[:1])).token_ids


def test_a_model_without_a_chat_template_refuses_messages_naming_them(
    stub: Stub, tiny_dir: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    bring_up(stub, bare)
    assert stub.GetInfo(pb.GetInfoRequest()).chat_template == ""
    chat = [pb.ChatMessage(role="user", content="hi")]
    _both_refuse(
        stub,
        chat,
        grpc.StatusCode.FAILED_PRECONDITION,
        "messages: the loaded model has no chat template",
    )
    assert stub.Tokenize(pb.TokenizeRequest(text="hi")).token_ids  # text still works


def _adds_bos(source: Path, out: Path) -> Path:
    """The tiny model with a tokenizer that adds a BOS (<|endoftext|>, id 0) to a text."""
    shutil.copytree(source, out)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = json.loads((out / name).read_text())
        config["bos_token"] = "<|endoftext|>"
        if name == "tokenizer_config.json":
            config["add_bos_token"] = True
        (out / name).write_text(json.dumps(config))
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    text = {"Sequence": {"id": "A", "type_id": 0}}
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, text],
        "pair": [bos, text, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def test_a_prompt_gets_the_bos_mlx_lm_gives_it_once(
    stub: Stub, tiny_dir: Path, tmp_path: Path
) -> None:
    """A text prompt gets the tokenizer's BOS as mlx_lm.generate gives it: none more when
    the text starts with the BOS already (it got two)."""
    model_dir = _adds_bos(tiny_dir, tmp_path / "bos")
    bring_up(stub, model_dir)
    model, tokenizer = load(str(model_dir))
    for text in ("Hello", "<|endoftext|>Hello"):
        ids = stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True)).token_ids
        assert ids[0] == 0 and list(ids).count(0) == 1, (text, ids)
        request = pb.GenerateRequest(prompt=text, sampling_params=greedy(1, ignore_eos=True))
        _, _, last = _collect(stub, request)
        [raw] = list(stream_generate(model, tokenizer, text, max_tokens=1))
        assert last.prompt_tokens == len(ids) == raw.prompt_tokens, text
