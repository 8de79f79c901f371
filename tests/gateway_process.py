"""A `mlx-worker gateway` process for the gateway tests, and the requests they send it.

`Gateway` runs one gateway in front of a worker and hands out `openai` clients
for it; `chat` and `complete` send the tests' greedy chat and prompt (EOS
ignored, so the tiny random model gives exact token counts).
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from processes import Proc

KEY = "sk-gateway-test-key"
OTHER_KEY = "sk-second-key"  # a second key in the same file
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
PROMPT = "Once upon a time"
NO_EOS = {"ignore_eos": True}  # vLLM's extra: exact token counts from the random model


class Gateway:
    """A `mlx-worker gateway` process in front of one worker; ready when /health is 200."""

    def __init__(self, worker_port: int, *options: str) -> None:
        self.worker_port = worker_port
        self.proc = Proc(
            ["gateway", "--worker", f"127.0.0.1:{worker_port}", "--port", "0", *options]
        )
        self.port = int(self.proc.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=60)
        headers = {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 120
        while self.http.get("/health", headers=headers).status_code != 200:
            assert time.monotonic() < deadline, f"no worker came up:\n{self.proc.output}"
            time.sleep(0.1)

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metric(self, line: str) -> float:
        text = self.http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        match = re.search(rf"^{re.escape(line)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def close(self) -> None:
        self.http.close()
        self.proc.reap()


def chat(client: openai.OpenAI, **options: Any) -> Any:
    """A chat completion of CHAT (greedy, EOS ignored unless `options` say otherwise)."""
    request: dict[str, Any] = {
        "model": "model",
        "messages": CHAT,
        "temperature": 0,
        "max_tokens": 24,
    }
    return client.chat.completions.create(**(request | {"extra_body": NO_EOS} | options))


def complete(client: openai.OpenAI, **options: Any) -> Any:
    """A legacy completion of PROMPT (greedy, EOS ignored)."""
    request: dict[str, Any] = {"model": "model", "prompt": PROMPT, "temperature": 0}
    request["extra_body"] = NO_EOS
    return client.completions.create(**(request | options))
