"""The OpenAI-compatible gateway end to end, driven by the official `openai` package.

A `mlx-worker serve --auto-init` process on the tiny random llama sits behind a
`mlx-worker gateway` process with an API key, both on loopback; the module shares
them. The worker's own Generate (over gRPC) is the reference for what the gateway
must answer: the same greedy text for the same chat or prompt. One test runs the
real SmolLM2 model behind a second gateway and compares it with `mlx_lm.generate`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from driver import ServeProcess, bring_up, wait_until_idle
from gateway_process import CHAT, KEY, OTHER_KEY, PROMPT, Gateway, chat, complete
from openai.types.chat import ChatCompletionMessageParam

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import WorkerServer


@pytest.fixture(scope="module")
def worker_stub(worker: ServeProcess) -> pb_grpc.WorkerServiceStub:
    return pb_grpc.WorkerServiceStub(worker.channel())


@pytest.fixture(scope="module")
def gateway(worker: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# two keys, for rotation\n{KEY}\n{OTHER_KEY}\n")
    gw = Gateway(worker.port, "--api-key-file", str(keys))
    yield gw
    gw.close()


def worker_generate(stub: pb_grpc.WorkerServiceStub, **request: Any) -> tuple[str, int, int]:
    """The worker's own Generate: (text, completion tokens, prompt tokens)."""
    messages = list(stub.Generate(pb.GenerateRequest(**request), timeout=60))
    last = messages[-1]
    return "".join(m.text for m in messages), last.completion_tokens, last.prompt_tokens


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---------------------------------------------------------------- tests
def test_models_health_and_metrics(gateway: Gateway, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["model"]  # the model directory's name
    assert client.models.retrieve("model").id == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = gateway.http.get("/health", headers={"Authorization": f"Bearer {KEY}"})
    assert health.json() == {"status": "ok", "workers_up": 1, "workers": 1, "queued": 0}
    # /health and /metrics need the key too (no --allow-health-without-token here).
    assert gateway.http.get("/health").status_code == 401
    assert gateway.http.get("/metrics").status_code == 401
    # The embedded fleet's metrics come along.
    assert gateway.metric(f'mlx_fleet_worker_up{{worker="127.0.0.1:{gateway.worker_port}"}}') == 1
    assert gateway.metric(
        'mlx_gateway_http_requests_total{method="GET",route="/health",status="401"}'
    )
    unknown = gateway.http.get("/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
    for made_up in ("ZZ1", "ZZ2"):  # made-up HTTP methods count as one "other" series
        assert gateway.http.request(made_up, "/health").status_code == 401
    assert (
        gateway.metric(
            'mlx_gateway_http_requests_total{method="other",route="/health",status="401"}'
        )
        == 2
    )


def test_chat_is_the_workers_greedy_answer_streamed_or_not(
    client: openai.OpenAI, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    want, count, prompt_tokens = worker_generate(
        worker_stub, messages=[pb.ChatMessage(**m) for m in CHAT], sampling_params=greedy(12)
    )
    assert count == 12 and want.strip()
    done = chat(client, max_tokens=12)
    [choice] = done.choices
    assert (choice.message.role, choice.message.content) == ("assistant", want)
    assert choice.finish_reason == "length"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 12)
    assert done.usage.total_tokens == prompt_tokens + 12
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"

    # max_completion_tokens, OpenAI's newer name, wins over max_tokens (24 here).
    stream = chat(
        client,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *body, usage = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == want
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (prompt_tokens, 12)
    assert len({c.id for c in chunks}) == 1


def test_completions_are_the_workers_greedy_answer_streamed_or_not(
    client: openai.OpenAI, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    want, _, prompt_tokens = worker_generate(worker_stub, prompt=PROMPT, sampling_params=greedy(10))
    done = complete(client, max_tokens=10)
    assert done.choices[0].text == want and done.object == "text_completion"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 10)
    chunks = list(complete(client, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # OpenAI's default max_tokens for legacy completions is 16.
    assert complete(client).usage.completion_tokens == 16


def test_a_stop_string_ends_the_answer_and_is_left_out(client: openai.OpenAI) -> None:
    full = chat(client).choices[0].message.content
    # A stop string from the middle of the text, at its first occurrence.
    start = next(
        i
        for i in range(len(full) // 3, len(full) - 3)
        if full.find(full[i : i + 3]) == i and full[i : i + 3].strip()
    )
    stop = full[start : start + 3]
    stopped = chat(client, stop=[stop, "never-there"]).choices[0]
    assert stopped.message.content == full[:start]
    assert stopped.finish_reason == "stop"
    chunks = list(chat(client, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_same_seed_gives_the_same_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        done = chat(client, temperature=1.0, top_p=0.95, seed=seed, max_tokens=16)
        return str(done.choices[0].message.content)

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_top_p_0_keeps_the_most_likely_token_on_both_apis(
    client: openai.OpenAI, gateway: Gateway
) -> None:
    # OpenAI and Anthropic take top_p 0 (the smallest nucleus): sampled, it is greedy.
    greedy = chat(client, max_tokens=12).choices[0].message.content
    for seed in (1, 2):
        done = chat(client, temperature=1.0, top_p=0, seed=seed, max_tokens=12)
        assert done.choices[0].message.content == greedy
    body = {"model": "model", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    headers = {"x-api-key": KEY}
    want = gateway.http.post("/v1/messages", json=body, headers=headers).json()
    sampled = body | {"temperature": 1.0, "top_p": 0}
    got = gateway.http.post("/v1/messages", json=sampled, headers=headers).json()
    assert got["content"] == want["content"], got


def test_logprobs_chat_and_legacy(client: openai.OpenAI) -> None:
    done = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert logprobs.model_extra == {} and "refusal" in logprobs.model_fields_set  # as OpenAI's
    assert len(logprobs.content) == 6
    assert "".join(t.token for t in logprobs.content) == done.choices[0].message.content
    for token in logprobs.content:
        assert len(token.top_logprobs) == 3
        top = [t.logprob for t in token.top_logprobs]
        assert top == sorted(top, reverse=True) and top[0] <= 0.0
        # Greedy: the sampled token is the most likely one.
        assert (token.token, token.logprob) == (token.top_logprobs[0].token, top[0])
        assert token.bytes == list(token.token.encode())

    legacy = complete(client, max_tokens=5, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for text, logprob, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(alts) == 2 and alts[text] == logprob == max(alts.values())
    # Sampled, the chosen token is always among the legacy top_logprobs (OpenAI's rule:
    # up to logprobs + 1 entries), the only one with logprobs: 0.
    for most in (1, 0):
        sampled = complete(client, max_tokens=12, logprobs=most, temperature=2.0, seed=4)
        lp = sampled.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        for text, logprob, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert alts[text] == logprob and len(alts) <= most + 1
            assert most or alts == {text: logprob}


@pytest.mark.parametrize(
    ("options", "status", "param"),
    [
        ({"temperature": 3.5}, 400, "temperature"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"n": 129}, 400, "n"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"top_logprobs": 5}, 400, "top_logprobs"),  # without logprobs=true
        ({"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"model": "gpt-4o"}, 404, "model"),
        # str.isdigit() is true of both; int() refuses the first and reads 3 from the second.
        ({"logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
        ({"logit_bias": {"45": 1, "045": -1}}, 400, "logit_bias"),  # one token twice
        # Past float32, which the worker's field is: it would arrive as inf.
        ({"extra_body": {"repetition_penalty": 1e300}}, 400, "repetition_penalty"),
        ({"user": 42}, 400, "user"),
        ({"metadata": [1, 2]}, 400, "metadata"),
        ({"metadata": {"tier": 1}}, 400, "metadata.tier"),
        ({"store": "yes"}, 400, "store"),
        ({"extra_body": {"stop_token_ids": ""}}, 400, "stop_token_ids"),
        ({"extra_body": {"min_tokens": 5}}, 400, "min_tokens"),  # past max_tokens 4
        # Nested fields are checked as the top level is: a misspelling is never ignored.
        ({"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, 400, "messages[0].bogus"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "b": 1}]}]},
            400,
            "messages[0].content[0].b",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "audio": {"id": "x"}}]},
            400,
            "messages[0].audio",
        ),
        (
            {"stream": True, "stream_options": {"include_usag": True}},
            400,
            "stream_options.include_usag",
        ),
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            400,
            "stream_options.continuous_usage_stats",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "scheme": {}},
                }
            },
            400,
            "response_format.json_schema.scheme",
        ),
        ({"response_format": {"type": "json_object", "schema": {}}}, 400, "response_format.schema"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]},
            400,
            "tools[0].function.params",
        ),
    ],
)
def test_bad_parameters_get_openai_errors(
    client: openai.OpenAI, options: dict[str, Any], status: int, param: str
) -> None:
    request: dict[str, Any] = {"model": "model", "messages": CHAT, "max_tokens": 4}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**(request | options))
    error = caught.value
    assert error.status_code == status
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    assert (error.param, error.type) == (param, "invalid_request_error")
    assert param.split("[", maxsplit=1)[0] in error.message


def test_every_response_carries_the_request_id_the_logs_show(
    client: openai.OpenAI, gateway: Gateway
) -> None:
    """x-request-id (docs/gateway.md): the answer's id, or the client's own id, which the
    answer's id is then built on; Anthropic's routes say it in request-id too."""
    raw = client.chat.completions.with_raw_response.create(
        model="model", messages=CHAT, max_tokens=2
    )
    done = raw.parse()
    assert raw.headers["x-request-id"] == done.id and done.id.startswith("chatcmpl-")
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "model", "messages": CHAT, "max_tokens": 2}
    for path, prefix in (("/v1/chat/completions", "chatcmpl-"), ("/v1/messages", "msg_")):
        for stream in (False, True):
            headers = auth | {"x-request-id": "trace-42"}
            sent = body | {"stream": stream}
            with gateway.http.stream("POST", path, json=sent, headers=headers) as response:
                text = response.read().decode()
            assert response.status_code == 200, text
            assert response.headers["x-request-id"] == "trace-42"
            assert f'"id":"{prefix}trace-42"' in text.replace(" ", "")
            anthropic = path == "/v1/messages"
            assert response.headers.get("request-id") == ("trace-42" if anthropic else None)
    twice = [("Authorization", f"Bearer {KEY}"), ("x-request-id", "a"), ("x-request-id", "b")]
    response = gateway.http.get("/v1/models/nope", headers=twice)  # one value "a, b": aside
    assert re.fullmatch("req_[0-9a-f]{32}", response.headers["x-request-id"])
    # Not 1 to 128 visible ASCII characters: left aside. No answer: a req_ id of its own.
    for headers, path, status in (
        (auth | {"x-request-id": "has space"}, "/v1/models/nope", 404),
        (auth | {"x-request-id": "x" * 129}, "/v1/models/nope", 404),
        ({"x-request-id": ""}, "/v1/models", 401),
    ):
        response = gateway.http.get(path, headers=headers)
        assert response.status_code == status
        assert re.fullmatch("req_[0-9a-f]{32}", response.headers["x-request-id"])


def test_a_body_that_repeats_a_key_is_a_400_naming_it(gateway: Gateway) -> None:
    """Python's JSON keeps a repeated key's last value: the first would be dropped."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path, body in (
        ("/v1/chat/completions", '{"messages": [], "max_tokens": 2, "max_tokens": 3}'),
        (
            "/v1/messages",
            '{"model": "m", "max_tokens": 2, "messages": [], "logit": {"28": 1, "28": 2}}',
        ),
    ):
        response = gateway.http.post(path, content=body.encode(), headers=auth)
        assert response.status_code == 400, response.text
        key = "max_tokens" if "chat" in path else "28"
        message = response.json()["error"]["message"]
        assert message.endswith(f'the key "{key}" appears twice in one object'), message


def test_api_keys(gateway: Gateway) -> None:
    with gateway.client("sk-wrong") as wrong, pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "Incorrect API key" in caught.value.message
    with gateway.client(OTHER_KEY) as second:  # every key in the file works
        assert [m.id for m in second.models.list()] == ["model"]
    bare = gateway.http.post("/v1/chat/completions", json={"messages": CHAT})
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["code"] == "invalid_api_key"


def test_browsers_get_cors_answers_only_from_the_allowed_origins(
    gateway: Gateway, worker: ServeProcess, tmp_path: Path
) -> None:
    """--allowed-origins answers a browser's preflight (which carries no API key) and
    marks the answers for that origin; the API key is still required of the request
    itself, and an origin not given, or a gateway without the flag, gets no CORS header."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY}\n")
    app = "https://app.example"
    preflight = {"origin": app, "access-control-request-method": "POST"}
    preflight["access-control-request-headers"] = "authorization, content-type"
    cors = Gateway(worker.port, "--api-key-file", str(keys), "--allowed-origins", app)
    try:
        answer = cors.http.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200, answer.text
        assert answer.headers["access-control-allow-origin"] == app
        assert "POST" in answer.headers["access-control-allow-methods"]
        keyed = {"origin": app, "authorization": f"Bearer {KEY}"}
        body = {"messages": CHAT, "max_tokens": 2}
        done = cors.http.post("/v1/chat/completions", json=body, headers=keyed)
        assert done.status_code == 200 and done.headers["access-control-allow-origin"] == app
        keyless = cors.http.post("/v1/chat/completions", json=body, headers={"origin": app})
        assert keyless.status_code == 401
        other = cors.http.options(
            "/v1/chat/completions", headers=preflight | {"origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
    finally:
        cors.close()
    plain = gateway.http.options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in plain.headers


def test_a_client_disconnect_mid_stream_frees_the_workers_kv(
    gateway: Gateway, client: openai.OpenAI, worker_stub: pb_grpc.WorkerServiceStub
) -> None:
    route = 'mlx_gateway_client_disconnects_total{route="/v1/chat/completions"}'
    before = gateway.metric(route)
    stream = chat(client, max_tokens=400, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        assert next(chunks).choices[0].delta.content is not None
    health = worker_stub.CheckHealth(pb.CheckHealthRequest(), timeout=30)
    assert health.num_running_requests == 1 and health.kv.used_blocks > 0, health
    stream.close()
    wait_until_idle(worker_stub, timeout=10)
    assert gateway.metric(route) == before + 1


def test_a_public_bind_needs_an_api_key_tls_or_insecure() -> None:
    command = ["gateway", "--worker", "127.0.0.1:1", "--host", "0.0.0.0"]
    done = subprocess.run(
        [sys.executable, "-m", "mlx_worker_svc", *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_API_KEY"},
    )
    assert done.returncode == 2
    assert "refusing to listen on 0.0.0.0" in done.stderr
    assert "--api-key-file (or MLX_GATEWAY_API_KEY)" in done.stderr


def test_an_address_it_cannot_listen_on_names_its_flags(gateway: Gateway) -> None:
    """A taken port or an unknown host: one line naming --host/--port and the cause, exit 2."""
    taken = ["--port", str(gateway.port)]
    for flags, line in (
        (taken, f"--host 127.0.0.1 --port {gateway.port}: cannot listen there (Address "),
        (["--host", "no-such-host.invalid", "--insecure"], "--host 'no-such-host.invalid'"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mlx_worker_svc", "gateway", "--worker", "127.0.0.1:1", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"mlx-worker gateway: {line}")


@pytest.mark.smollm
def test_greedy_chat_through_the_gateway_is_mlx_lm_generate(
    server: WorkerServer, stub: pb_grpc.WorkerServiceStub, smollm_f32_dir: Path
) -> None:
    from mlx_lm import generate, load

    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital of France?"}
    ]
    # SmolLM2 expanded to float32 (its 4-bit forwards take 0.1 s a token on a CPU).
    bring_up(stub, smollm_f32_dir, num_blocks=256, profile_tokens=16)
    gw = Gateway(server.port)
    try:
        with gw.client() as client:
            done = client.chat.completions.create(
                model=smollm_f32_dir.name, messages=question, temperature=0, max_tokens=24
            )
    finally:
        gw.close()
    model, tokenizer = load(str(smollm_f32_dir))
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    want = generate(model, tokenizer, prompt=prompt, max_tokens=24)
    assert done.choices[0].message.content == want
    assert "Paris" in want
    assert done.choices[0].finish_reason == "stop"  # EOS before 24 tokens
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
