"""SmolLM2 behind the gateway with the `openai` client: JSON schemas, tool calls, tool results.

SmolLM2's own chat template renders no tools, so the model directory (its
weights expanded to float32, fast through BLAS on a CPU) is copied with a
Hermes-style template that does (`tiny_model.TOOL_TEMPLATE`). A real
model, greedy: the JSON must validate against the schema, the calls must name
the tool and their arguments validate against its parameters, streamed and
not, and a conversation that sends the tool's result back gets an answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from driver import ServeProcess
from gateway_process import Gateway
from tiny_model import tool_model_copy

pytestmark = pytest.mark.smollm

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    }
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(
    tmp_path_factory: pytest.TempPathFactory, smollm_f32_dir: Path
) -> Iterator[openai.OpenAI]:
    model = tool_model_copy(smollm_f32_dir, tmp_path_factory.mktemp("smollm-tools") / "model")
    worker = ServeProcess(model, 1.0)
    gateway = Gateway(worker.port)
    try:
        with gateway.client() as c:
            yield c
    finally:
        gateway.close()
        worker.reap()


def chat(client: openai.OpenAI, **options: Any) -> Any:
    request: dict[str, Any] = {"model": "model", "messages": ASK, "temperature": 0}
    return client.chat.completions.create(**(request | {"max_tokens": 64} | options))


def test_smollm_answers_json_schemas_and_calls_tools(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Describe the city of Paris as JSON."}]
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    done = chat(client, messages=ask, response_format=response_format)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), CITY)

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        one = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
        done = chat(client, **one)
        [call] = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        streamed = list(chat(client, stream=True, **one))
        deltas = [
            c.choices[0].delta.tool_calls[0] for c in streamed if c.choices[0].delta.tool_calls
        ]
        assert deltas[0].function.name == "get_weather"
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments
        assert streamed[-1].choices[0].finish_reason == "tool_calls"

    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=48)
    message = answer.choices[0].message
    assert message.tool_calls is None and message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
