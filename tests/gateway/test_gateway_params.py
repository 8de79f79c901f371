"""The gateway's parameters as outside clients send them: tool fields, logprobs, context errors.

A `mlx-worker serve --auto-init` process on the tiny random llama behind a
`mlx-worker gateway` process, driven with the official `openai` package and
with raw HTTP (httpx), as agent and IDE clients call it. The greedy answer of
the same chat without the extra fields is the reference: a field accepted as a
no-op must not change it.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx
import openai
import pytest
from driver import ServeProcess
from gateway_process import CHAT, NO_EOS, PROMPT, Gateway, chat, complete

from mlx_worker_svc.core.errors import Code
from mlx_worker_svc.fleet import ContextTooLong, FleetScheduler, OutOfVocabulary
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def model(worker: ServeProcess) -> pb.GetInfoResponse:
    return pb_grpc.WorkerServiceStub(worker.channel()).GetInfo(pb.GetInfoRequest(), timeout=30)


def post(gateway: Gateway, route: str, body: dict[str, Any]) -> httpx.Response:
    """A raw POST, as a client without an SDK sends it."""
    return gateway.http.post(route, json=body)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-events body, [DONE] left out."""
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]", response.text
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------- tools (item 11)
NO_TOOL_CALL = [
    {"tools": []},
    {"tool_choice": "none"},
    {"tools": [], "tool_choice": "none"},
    {"tool_choice": "auto"},
    {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True},
    {"parallel_tool_calls": False},
    # Offered under "none": the answer is text, so the tools are not needed.
    {"tools": [WEATHER], "tool_choice": "none"},
]


@pytest.mark.parametrize("options", NO_TOOL_CALL)
def test_tool_fields_that_call_no_tool_are_no_ops(
    client: openai.OpenAI, gateway: Gateway, options: dict[str, Any]
) -> None:
    want = chat(client, max_tokens=8).choices[0].message.content
    done = chat(client, max_tokens=8, **options)
    [choice] = done.choices
    assert (choice.message.content, choice.finish_reason) == (want, "length")
    assert choice.message.tool_calls is None
    body = {"model": "model", "messages": CHAT, "temperature": 0, "max_tokens": 8} | NO_EOS
    raw = post(gateway, "/v1/chat/completions", body | options | {"stream": True})
    assert raw.status_code == 200, raw.text
    chunks = events(raw)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


@pytest.mark.parametrize(
    ("options", "param"),
    [
        # A tool the model may call ("auto" is the default) needs a chat template that
        # renders tools; SmolLM2's (the tiny model's) does not.
        ({"tools": [WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            "tools",
        ),
        # Malformed.
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0]"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_tool_fields_a_model_cannot_serve_are_a_400_naming_the_field(
    gateway: Gateway, options: dict[str, Any], param: str
) -> None:
    body = {"model": "model", "messages": CHAT, "max_tokens": 4}
    for stream in (False, True):
        response = post(gateway, "/v1/chat/completions", body | options | {"stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["type"]) == (param, "invalid_request_error")
        assert f"'{param}'" in error["message"]


# --------------------------------------------- what every call sends
def test_fields_clients_send_on_every_call_are_accepted(
    client: openai.OpenAI, gateway: Gateway
) -> None:
    want = chat(client, max_tokens=8).choices[0].message.content
    everyday: dict[str, Any] = {
        "n": 1,
        "user": "user-1234",
        "seed": 7,
        "response_format": {"type": "text"},
        "logit_bias": {"50": 0},
        "max_completion_tokens": 8,
        "store": False,
        "metadata": {"session": "abc"},
        "logprobs": False,
        "stop": [],
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "top_p": 1,
        # Hints OpenAI takes on every chat model, and reasoning knobs (vLLM takes them too).
        "service_tier": "auto",
        "prompt_cache_key": "session-abc",
        "safety_identifier": "user-hash",
        "prompt_cache_retention": "24h",
        "reasoning_effort": "low",
        "verbosity": "low",
        "modalities": ["text"],  # the text every answer is
    }
    done = chat(client, **everyday)
    assert done.choices[0].message.content == want
    stream = chat(client, **everyday, stream=True, stream_options={"include_usage": True})
    *body, usage = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in body) == want
    assert usage.usage is not None and usage.usage.completion_tokens == 8
    legacy = {"n": 1, "user": "u", "seed": 7, "logit_bias": {"50": 0}, "echo": False}
    legacy |= {"best_of": 1, "suffix": None, "logprobs": None}
    assert complete(client, max_tokens=6, **legacy).choices[0].text == (
        complete(client, max_tokens=6).choices[0].text
    )
    # A refusal still names the field, nested ones by their path.
    bad = post(
        gateway,
        "/v1/chat/completions",
        {"messages": CHAT, "stream": True} | {"stream_options": {"include_usage": "yes"}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options.include_usage"
    bad = post(gateway, "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"50": 300}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias.50"
    suffix: object
    # Continue sends its dozen stop words on every request; 16 are taken, 17 are not.
    stops = [
        f"\n\n{word}" for word in ["def", "class", "if", "for", "while", "with", "try", "return"]
    ]
    stops += ["<|im_end|>", "\n```", "/src/", "#- coding", "\n# ", "<fim_", "</s>", "\n}"]
    assert post(gateway, "/v1/completions", {"prompt": PROMPT, "stop": stops}).status_code == 200
    for name, bad_value in (
        ("service_tier", "fastest"),
        ("prompt_cache_key", 7),
        ("modalities", ["text", "audio"]),
        ("stop", [*stops, "one more"]),
    ):
        bad = post(gateway, "/v1/chat/completions", {"messages": CHAT, name: bad_value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name
    # An assistant's refusal part (as the SDK hands it back) is its text in the history,
    # and an assistant message as the SDK dumps it (nulls, annotations) is taken.
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    dumped: dict[str, Any] = {"role": "assistant", "content": "Hi.", "refusal": None}
    dumped |= {"annotations": []}
    dumped |= {"audio": None, "function_call": None, "tool_calls": None}
    history = [*CHAT, refused, {"role": "user", "content": "Why?"}, dumped]
    history.append({"role": "user", "content": [{"type": "text", "text": "And?"}]})
    assert (
        post(gateway, "/v1/chat/completions", {"messages": history, "max_tokens": 2}).status_code
        == 200
    )
    # The message's own refusal string (the SDK's form) is the same text as the part.
    as_field = {"role": "assistant", "content": None, "refusal": "I can't."}
    counts = [
        post(
            gateway, "/v1/chat/completions", {"messages": [*CHAT, m, *CHAT], "max_tokens": 1}
        ).json()["usage"]["prompt_tokens"]
        for m in (refused, as_field)
    ]
    assert counts[0] == counts[1], counts
    user_refusal = {"role": "user", "content": "x", "refusal": "no"}
    bad = post(gateway, "/v1/chat/completions", {"messages": [user_refusal]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].refusal"
    for suffix in (0, [], {}):
        bad = post(gateway, "/v1/completions", {"prompt": PROMPT, "suffix": suffix})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"
    assert post(gateway, "/v1/completions", {"prompt": PROMPT, "suffix": ""}).status_code == 200
    # NaN and Infinity are Python's json, not JSON (RFC 8259): the body does not parse.
    for constant in ("NaN", "Infinity", "-Infinity"):
        raw = f'{{"prompt": "x", "max_tokens": 1, "user": {constant}}}'
        bad = gateway.http.post("/v1/completions", content=raw)
        error = bad.json()["error"]
        assert bad.status_code == 400 and constant in error["message"], error
    # An integer longer than Python converts (4,300 digits) is refused by its path.
    big = "9" * 5000
    schema = '{"type": "object", "properties": {"a": {"default": ' + big + "}}}"
    form = '{"type": "json_schema", "json_schema": {"name": "n", "schema": ' + schema + "}}"
    for name, value in (
        ("max_tokens", big),
        ("temperature", "-" + big),
        ("response_format.json_schema.schema.properties.a.default", form),
    ):
        raw = f'{{"prompt": "x", "{name.split(".")[0]}": {value}}}'
        bad = gateway.http.post("/v1/completions", content=raw)
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["param"] == name, error
        assert "5000 digits" in error["message"] and "sys." not in error["message"], error


# ------------------------------------------ logprobs and the stop token (item 12)
def test_logprobs_leave_out_the_stop_token(
    client: openai.OpenAI, gateway: Gateway, model: pb.GetInfoResponse
) -> None:
    # EOS pushed up by logit_bias and held back by min_tokens: 5 tokens of text, then EOS.
    eos = model.model.eos_token_ids[0]
    ends: dict[str, Any] = {"logit_bias": {str(eos): 100}, "extra_body": {"min_tokens": 5}}
    done = chat(client, logprobs=True, top_logprobs=2, **ends)
    [choice] = done.choices
    assert choice.finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens == 6  # EOS is generated
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = [t.token for t in choice.logprobs.content]
    assert len(tokens) == 5 and "".join(tokens) == choice.message.content

    chunks = list(chat(client, logprobs=True, stream=True, **ends))
    streamed = [
        t.token
        for c in chunks
        if c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert streamed == tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"

    for stream in (False, True):
        legacy = {"prompt": PROMPT, "temperature": 0, "logprobs": 1, "max_tokens": 16}
        legacy |= {"logit_bias": {str(eos): 100}, "min_tokens": 5, "stream": stream}
        response = post(gateway, "/v1/completions", {"model": "model"} | legacy)
        assert response.status_code == 200, response.text
        parts = events(response) if stream else [response.json()]
        text = "".join(p["choices"][0]["text"] for p in parts)
        lps = [p["choices"][0]["logprobs"] for p in parts if p["choices"][0]["logprobs"]]
        words = [t for lp in lps for t in lp["tokens"]]
        assert len(words) == 5 and "".join(words) == text
        offsets = [o for lp in lps for o in lp["text_offset"]]
        assert offsets == [len("".join(words[:i])) for i in range(5)]
        assert parts[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_parts_are_joined_with_a_newline(gateway: Gateway) -> None:
    """gateway.md: the parts give the newline-joined string's prompt and answer."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    answers = [
        post(
            gateway,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": c}], "max_tokens": 4, "temperature": 0},
        ).json()
        for c in (parts, "hi\nthere")
    ]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]


def test_logprob_bytes_of_characters_split_over_tokens_join_to_them(gateway: Gateway) -> None:
    """A character the tokenizer splits into byte tokens: each token's `bytes` are its own
    (joined: the text's UTF-8), its `token` is `bytes:\\x..` (tiktoken's notation), and
    legacy `text_offset` points at the character each token's first byte is in."""
    text = "🌍 日本"
    force = {"structured_outputs": {"regex": text}, "temperature": 0, "max_tokens": 24}
    ask = {"model": "model", "messages": CHAT, "logprobs": True}
    done = post(gateway, "/v1/chat/completions", ask | force)
    [choice] = done.json()["choices"]
    assert choice["message"]["content"] == text, done.text
    content = choice["logprobs"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in content) == text.encode()
    partial = [t for t in content if t["token"].startswith("bytes:")]
    assert partial, content  # the noise split a character (the regex takes any tokens)
    for token in partial:
        assert token["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in token["bytes"])
    for token in content:
        if token not in partial:
            assert list(token["token"].encode()) == token["bytes"]
    ask = {"model": "model", "prompt": PROMPT, "logprobs": 1}
    legacy = post(gateway, "/v1/completions", ask | force)
    [choice] = legacy.json()["choices"]
    assert choice["text"] == text, legacy.text
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert len(tokens) == len(offsets) and offsets[0] == 0
    starts, at = [], 0  # where each token's first byte's character begins
    for token in tokens:
        partial = token.startswith("bytes:")
        raw = bytes.fromhex(token[6:].replace("\\x", "")) if partial else token.encode()
        starts.append(len(text.encode()[:at].decode("utf-8", "ignore")))
        at += len(raw)
    assert offsets == starts and at == len(text.encode())


def test_a_plain_stop_token_is_left_out_of_the_text_and_the_logprobs(
    client: openai.OpenAI, worker: ServeProcess
) -> None:
    # The greedy answer's 6th token, as a stop token: it ends the answer without its text
    # (as vLLM's include_stop_str_in_output false), and like EOS it has no entry.
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in CHAT],
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    ids = [t for m in stub.Generate(request, timeout=60) for t in m.token_ids]
    assert ids[5] not in ids[:5]
    for stream in (False, True):
        done = chat(client, logprobs=True, stream=stream, extra_body={"stop_token_ids": [ids[5]]})
        chunks = list(done) if stream else [done]
        content = "".join(
            (c.choices[0].delta.content if stream else c.choices[0].message.content) or ""
            for c in chunks
        )
        tokens = [
            t.token
            for c in chunks
            if c.choices[0].logprobs
            for t in c.choices[0].logprobs.content or []
        ]
        assert len(tokens) == 5 and "".join(tokens) == content
        shown = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids[:5]), timeout=30).text
        assert content == shown
        assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------ the context length (item 13)
def test_a_request_past_the_context_is_a_400_in_the_apis_terms(
    gateway: Gateway, worker: ServeProcess, model: pb.GetInfoResponse
) -> None:
    limit = model.model.max_context_length
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    ask = pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in CHAT])
    prompt = len(stub.Tokenize(ask, timeout=30).token_ids)
    start = f"This model's maximum context length is {limit} tokens. However, "

    def refused(route: str, body: dict[str, Any]) -> dict[str, Any]:
        for stream in (False, True):
            response = post(gateway, route, {"model": "model", "stream": stream} | body)
            assert response.status_code == 400, response.text
            error: dict[str, Any] = response.json()["error"]
            assert (error["type"], error["code"]) == (
                "invalid_request_error",
                "context_length_exceeded",
            )
        return error

    over = limit - prompt + 1
    for name in ("max_tokens", "max_completion_tokens"):
        error = refused("/v1/chat/completions", {"messages": CHAT, name: over})
        assert error["param"] == "messages"
        assert error["message"] == start + (
            f"you requested {limit + 1} tokens ({prompt} in the messages, {over} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    # Exactly the context fits: the stream starts.
    body = {"model": "model", "messages": CHAT, "max_tokens": limit - prompt, "stream": True}
    with gateway.http.stream("POST", "/v1/chat/completions", json=body) as fits:
        assert fits.status_code == 200
    # Without max_tokens the answer may run to the end of the context: only the prompt counts.
    long_chat = [{"role": "user", "content": "sea " * limit}]
    ask = pb.TokenizeRequest(messages=[pb.ChatMessage(**m) for m in long_chat])
    long_prompt = len(stub.Tokenize(ask, timeout=30).token_ids)
    error = refused("/v1/chat/completions", {"messages": long_chat})
    assert (error["param"], error["message"]) == (
        "messages",
        start + f"your messages resulted in {long_prompt} tokens. "
        "Please reduce the length of the messages.",
    )

    # Legacy completions: max_tokens defaults to 16, and it counts.
    for tokens, max_tokens in ((limit + 88, {"max_tokens": 4}), (limit - 8, {})):
        wanted = max_tokens.get("max_tokens", 16)
        error = refused("/v1/completions", {"prompt": [5] * tokens} | max_tokens)
        assert (error["param"], error["message"]) == (
            "prompt",
            start + f"you requested {tokens + wanted} tokens ({tokens} in the prompt, "
            f"{wanted} in the completion). Please reduce the length of the prompt or completion.",
        )
    prompt_text = PROMPT + " sea" * limit
    error = refused("/v1/completions", {"prompt": prompt_text, "max_tokens": 1})
    assert error["param"] == "prompt" and "in the prompt, 1 in the completion" in error["message"]


@pytest.mark.parametrize(
    ("route", "body", "param", "token"),
    [
        # OpenAI's tokenizer ids, as a client ported from it sends them.
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logit_bias": {"50256": -100}},
            "logit_bias",
            50256,
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stop_token_ids": [2, 10**6]},
            "stop_token_ids",
            10**6,
        ),
        ("/v1/completions", {"prompt": [5, 99999, 5]}, "prompt", 99999),
    ],
)
def test_a_token_id_past_the_vocabulary_is_a_400_naming_its_field(
    gateway: Gateway,
    model: pb.GetInfoResponse,
    route: str,
    body: dict[str, Any],
    param: str,
    token: int,
) -> None:
    vocab = model.model.vocab_size
    for stream in (False, True):
        response = post(gateway, route, {"model": "model", "stream": stream} | body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value")
        assert error["message"] == (
            f"Invalid value for '{param}': token {token} is out of the vocabulary (size {vocab})"
        )


def test_the_fleet_refuses_what_the_model_cannot_take_before_routing_it(
    worker: ServeProcess, model: pb.GetInfoResponse
) -> None:
    limit = model.model.max_context_length

    async def first(
        fleet: FleetScheduler, request: pb.GenerateRequest, reserve: bool
    ) -> pb.GenerateResponse:
        stream = fleet.generate(request, reserve_max_tokens=reserve)
        try:
            return await anext(stream)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def run() -> None:
        fleet = FleetScheduler([f"127.0.0.1:{worker.port}"])  # its channels bind to this loop
        await fleet.start()
        try:
            await fleet.wait_ready()
            too_long = pb.GenerateRequest(prompt_token_ids=[5] * (limit + 1))
            with pytest.raises(ContextTooLong) as caught:
                await first(fleet, too_long, False)
            assert caught.value.code == Code.INVALID_ARGUMENT
            assert str(caught.value) == (
                f"prompt_token_ids: the prompt has {limit + 1} tokens; "
                f"the model's context length is {limit} tokens"
            )
            chat = [pb.ChatMessage(role="user", content="hi " * limit)]
            for text in (
                pb.GenerateRequest(prompt="hi " * limit),
                pb.GenerateRequest(messages=chat),
            ):
                with pytest.raises(ContextTooLong) as caught:
                    await first(fleet, text, False)
                field = "messages" if text.messages else "prompt"
                assert str(caught.value).startswith(f"{field}: the prompt has ")
            with pytest.raises(OutOfVocabulary) as vocab:
                params = pb.SamplingParams(logit_bias={limit: 1.0, 10**6: -1.0})
                await first(
                    fleet, pb.GenerateRequest(prompt_token_ids=[5], sampling_params=params), False
                )
            assert str(vocab.value) == (
                "sampling_params.logit_bias: token 1000000 is out of the vocabulary "
                f"(size {model.model.vocab_size})"
            )
            # Without room for max_tokens: the worker's rule stops the answer at the context's
            # end; OpenAI's rule (reserve_max_tokens) refuses it.
            params = pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            tight = pb.GenerateRequest(prompt_token_ids=[5] * (limit - 4), sampling_params=params)
            assert (await first(fleet, tight, False)).token_ids
            with pytest.raises(ContextTooLong) as caught:
                await first(fleet, tight, True)
            assert (caught.value.prompt_tokens, caught.value.max_tokens) == (limit - 4, 8)
            assert "and max_tokens is 8" in str(caught.value)
        finally:
            await fleet.stop()

    asyncio.run(run())


def test_sigterm_drains_the_gateway_and_ends_what_is_left_in_the_apis_shape(
    worker: ServeProcess,
) -> None:
    """On SIGTERM, /health says draining (503) and a new request is a 503 in OpenAI's
    shape while one in flight finishes; with no grace left, a stream still running ends
    with a last `data: {"error": ...}` event, not a broken connection."""
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    for grace in ("30", "0"):
        gw = Gateway(worker.port, "--grace-seconds", grace)
        try:
            with gw.http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first.removeprefix("data: "))["choices"]
                gw.proc.proc.send_signal(signal.SIGTERM)
                if grace != "0":
                    health = gw.http.get("/health")
                    assert (health.status_code, health.json()["status"]) == (503, "draining")
                    assert health.json()["workers_up"] == 1  # still up: the gateway goes
                    late = post(gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
                    assert late.status_code == 503
                    assert "the fleet is shutting down" in late.json()["error"]["message"]
                rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            if grace != "0":
                assert rest[-1] == "[DONE]"
                assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
            else:
                error = json.loads(rest[-1])["error"]
                assert "the fleet shut down before the request finished" in error["message"]
            assert gw.proc.proc.wait(timeout=60) == 0
            assert "Traceback" not in gw.proc.output
        finally:
            gw.close()


def test_a_second_stop_cuts_the_gateways_drain_short() -> None:
    """The second SIGTERM (`GatewayServer.stop` again) ends the grace period at once:
    the request in flight gets its error in the API's shape and the server ends, not
    after --grace-seconds."""
    from mlx_worker_svc.fleet import FleetConfig
    from mlx_worker_svc.gateway import GatewayConfig, GatewayServer

    async def run() -> tuple[int, str, float]:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig())  # the request waits for it
        server = GatewayServer(fleet, "127.0.0.1", 0, GatewayConfig(), grace=120.0)
        await server.start()
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            body = {"prompt": PROMPT, "max_tokens": 2}
            answer = asyncio.create_task(http.post("/v1/completions", json=body, timeout=60))
            while not fleet.status().num_queued:
                await asyncio.sleep(0.02)
            server.stop()
            await asyncio.sleep(1.0)
            assert not answer.done()  # the first stop waits for the request
            started = loop.time()
            server.stop()
            response = await asyncio.wait_for(answer, 30)
            await asyncio.wait_for(server.wait(), 30)
        return response.status_code, response.json()["error"]["message"], loop.time() - started

    status, message, took = asyncio.run(run())
    assert status == 503 and "the fleet shut down before the request finished" in message
    assert "(a second stop signal cut the drain short)" in message
    assert took < 20  # not the 120 s grace, nor the 30 s wait for a worker
