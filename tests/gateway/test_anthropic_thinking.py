"""Anthropic's `thinking` through the gateway: agents send it on every request.

Claude Code sends `thinking: {"type": "adaptive"}` by default; the option allows
thinking and never requires it, so an answer without thinking blocks (the served
models' reasoning is not parsed into them) is what it allows. The answer must be
the one the same request gets without the option, streamed or not, and its shape
is checked as Anthropic's API checks it. Thinking blocks an agent sends back in
an assistant turn are left out of the prompt, as Anthropic's API leaves earlier
turns' thinking out of the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from driver import ServeProcess
from gateway_process import KEY, Gateway

MODEL = "model"
ASK: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def gateway(tiny_tools_dir: Path) -> Iterator[Gateway]:
    proc = ServeProcess(tiny_tools_dir, 1.0)
    gw = Gateway(proc.port)
    yield gw
    gw.close()
    proc.reap()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _text(message: Any) -> str:
    assert [block.type for block in message.content] == ["text"]
    return str(message.content[0].text)


@pytest.mark.parametrize(
    "thinking",
    [
        {"type": "adaptive"},
        {"type": "adaptive", "budget_tokens": 0},  # as Claude Code sends it
        {"type": "enabled", "budget_tokens": 1024},
        {"type": "adaptive", "display": "omitted"},
        {"type": "disabled"},
    ],
)
def test_thinking_is_allowed_and_the_answer_is_the_same(
    client: anthropic.Anthropic, thinking: dict[str, Any]
) -> None:
    # "enabled" needs max_tokens past its budget (1024); the others answer 16 tokens.
    most = 1025 if thinking["type"] == "enabled" else 16
    request: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": most}
    greedy: dict[str, Any] = {"extra_body": {"temperature": 0, "thinking": thinking}}
    plain = _text(client.messages.create(**request, extra_body={"temperature": 0}))
    assert _text(client.messages.create(**request, **greedy)) == plain
    with client.messages.stream(**request, **greedy) as stream:
        assert "".join(stream.text_stream) == plain
    counted = client.messages.count_tokens(model=MODEL, messages=ASK)
    with_thinking = client.messages.count_tokens(
        model=MODEL, messages=ASK, extra_body={"thinking": thinking}
    )
    assert with_thinking.input_tokens == counted.input_tokens


@pytest.mark.parametrize(
    ("thinking", "says"),
    [
        ({"type": "enabled", "budget_tokens": 1023}, "greater than or equal to 1024"),
        ({"type": "enabled"}, "thinking.budget_tokens': Field required"),
        ({"type": "enabled", "budget_tokens": 2048}, "max_tokens must be greater than"),
        ({"type": "adaptive", "budget_tokens": -1}, "greater than or equal to 0"),
        ({"type": "sometimes"}, "'enabled', 'adaptive' or 'disabled'"),
        ({"type": "disabled", "budget_tokens": 5}, "thinking.budget_tokens': Extra inputs"),
        ({"type": "adaptive", "depth": 3}, "thinking.depth': Extra inputs"),
        ({"type": "adaptive", "display": "full"}, "expected 'summarized' or 'omitted'"),
        ("yes", "'enabled', 'adaptive' or 'disabled'"),
    ],
)
def test_a_malformed_thinking_is_a_400_naming_it(
    gateway: Gateway, thinking: Any, says: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2048, "thinking": thinking}
    response = gateway.http.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], error


def test_thinking_blocks_sent_back_are_left_out_of_the_prompt(
    client: anthropic.Anthropic,
) -> None:
    earlier = "The sea is large."
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": earlier},
        {"role": "user", "content": "And the sky?"},
    ]
    thought: list[Any] = [
        {"type": "thinking", "thinking": "Let me think.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "text", "text": earlier},
    ]
    with_blocks: list[Any] = [*history[:1], {"role": "assistant", "content": thought}, *history[2:]]
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "extra_body": {"temperature": 0}}
    plain = client.messages.create(messages=history, **greedy)
    answer = client.messages.create(messages=with_blocks, **greedy)
    assert _text(answer) == _text(plain)

    def prompt(message: Any) -> int:  # the prefix cache moves tokens into cache reads
        return int(message.usage.input_tokens + message.usage.cache_read_input_tokens)

    assert prompt(answer) == prompt(plain)
    # A prefill (a final assistant turn) with thinking blocks: they are left out too.
    prefill = [
        *ASK,
        {"role": "assistant", "content": [*thought[:2], {"type": "text", "text": "The sea"}]},
    ]
    continued = client.messages.create(messages=prefill, **greedy)
    plain_prefill = [*ASK, {"role": "assistant", "content": "The sea"}]
    assert _text(continued) == _text(client.messages.create(messages=plain_prefill, **greedy))
    with pytest.raises(anthropic.BadRequestError, match=r"content\[0\].extra"):
        bad: list[Any] = [{**thought[0], "extra": 1}, thought[2]]
        turns: list[Any] = [*history[:1], {"role": "assistant", "content": bad}, *history[2:]]
        client.messages.create(messages=turns, **greedy)


CLAUDE_CODE_EDITS = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}


def test_claude_codes_context_management_is_taken(client: anthropic.Anthropic) -> None:
    """Claude Code sends clear_thinking beside adaptive thinking: it changes nothing here
    (thinking blocks never reach the prompt), so the answer and the count stay the same."""
    request: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 16}
    plain = _text(client.messages.create(**request, extra_body={"temperature": 0}))
    body = {"temperature": 0, "thinking": {"type": "adaptive"}, "speed": "fast"}
    body["context_management"] = CLAUDE_CODE_EDITS
    assert _text(client.messages.create(**request, extra_body=body)) == plain
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}]}
    body["context_management"] = keep_all
    assert _text(client.messages.create(**request, extra_body=body)) == plain
    counted = client.messages.count_tokens(model=MODEL, messages=ASK)
    extra = {"thinking": {"type": "adaptive"}, "context_management": CLAUDE_CODE_EDITS}
    extra["output_config"] = {"effort": "high"}  # the answer's, not the prompt's
    assert client.messages.count_tokens(
        model=MODEL, messages=ASK, extra_body=extra
    ).input_tokens == (counted.input_tokens)


@pytest.mark.parametrize(
    ("management", "thinking", "says"),
    [
        (
            {"edits": [{"type": "clear_tool_uses_20250919"}]},
            {"type": "adaptive"},
            "edits[0]': the 'clear_tool_uses_20250919' edit is not supported",
        ),
        (CLAUDE_CODE_EDITS, {"type": "disabled"}, "requires `thinking` to be enabled or adaptive"),
        (CLAUDE_CODE_EDITS, None, "requires `thinking` to be enabled or adaptive"),
        (
            {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]},
            {"type": "adaptive"},
            "edits[0].keep': expected 'all'",
        ),
        ({"edits": [], "mode": 1}, {"type": "adaptive"}, "context_management.mode'"),
        ("all", {"type": "adaptive"}, "expected an object with 'edits'"),
    ],
)
def test_context_management_this_server_cannot_do_is_a_400(
    gateway: Gateway, management: Any, thinking: Any, says: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 16}
    body["context_management"] = management
    if thinking is not None:
        body["thinking"] = thinking
    response = gateway.http.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"], response.text


def test_a_tools_image_is_a_line_of_text_saying_so(client: anthropic.Anthropic) -> None:
    """Claude Code's Read tool returns images; the result stays in every later turn, so
    the image is written as a line saying a text model cannot read it (the same prompt
    as that line given as text), and a user's own image is still a 400."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
    }
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.png"}}
    tools: list[Any] = [{"name": "Read", "input_schema": {"type": "object"}}]

    def turns(content: list[Any]) -> list[Any]:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
        return [
            *ASK,
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ]

    said = {"type": "text", "text": "[an image the tool returned: this model reads text only]"}
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "tools": tools}
    greedy["extra_body"] = {"temperature": 0}
    with_image = client.messages.create(messages=turns([image]), **greedy)
    as_text = client.messages.create(messages=turns([said]), **greedy)
    assert with_image.content == as_text.content
    counted = client.messages.count_tokens(model=MODEL, messages=turns([image]), tools=tools)
    assert counted.input_tokens == (
        client.messages.count_tokens(model=MODEL, messages=turns([said]), tools=tools).input_tokens
    )
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].content\[0\]"):
        own: list[Any] = [{"role": "user", "content": [image]}]
        client.messages.create(messages=own, **greedy)


def test_a_failed_tool_result_says_so_in_its_text(client: anthropic.Anthropic) -> None:
    """Claude Code and Cline mark a failed call `is_error: true`: the model reads a line
    saying so before the result (the same prompt as that line given as text); false is
    the same as leaving it out."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"cmd": "ls"}}
    tools: list[Any] = [{"name": "Bash", "input_schema": {"type": "object"}}]

    def count(text: str, **flag: Any) -> int:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": text, **flag}
        turns: list[Any] = [
            *ASK,
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ]
        return client.messages.count_tokens(model=MODEL, messages=turns, tools=tools).input_tokens

    said = count("[the tool call failed]\nno such file")
    assert count("no such file", is_error=True) == said
    assert count("no such file", is_error=False) == count("no such file") < said


def test_the_anthropic_sdk_lists_the_models(client: anthropic.Anthropic, gateway: Gateway) -> None:
    """/v1/models answers both SDKs: OpenAI's fields and Anthropic's (type, display_name,
    created_at, the paging ids)."""
    page = client.models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [(MODEL, "model", MODEL)]
    assert page.data[0].created_at.year >= 2025
    assert (page.first_id, page.last_id, page.has_more) == (MODEL, MODEL, False)
    assert [m.id for m in client.models.list(limit=1)] == [MODEL]  # the SDK's own paging
    assert client.models.list(after_id=MODEL).data == []
    with pytest.raises(anthropic.BadRequestError, match="limit"):
        client.models.list(limit=0)
    assert client.models.retrieve(MODEL).display_name == MODEL
    openai_view = gateway.http.get("/v1/models").json()
    assert openai_view["object"] == "list" and openai_view["data"][0]["object"] == "model"
