"""The real SmolLM2-135M-Instruct model: greedy parity with mlx-lm, chat answers."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from driver import bring_up, drive
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.smollm
Stub = pb_grpc.WorkerServiceStub
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "List two planets of the solar system.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompts(smollm_dir: Path) -> list[list[int]]:
    _, tokenizer = load(str(smollm_dir))
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True
            )
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(smollm_dir: Path, chat_prompts: list[list[int]]) -> list[list[int]]:
    """mlx-lm's greedy tokens (what mlx_lm.generate produces), EOS included."""
    model, tokenizer = load(str(smollm_dir))
    eos = set(tokenizer.eos_token_ids)
    refs = []
    for prompt in chat_prompts:
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
            tokens.append(int(token))
            if token in eos:
                break
        refs.append(tokens)
    return refs


@pytest.fixture
def smol_stub(stub: Stub, smollm_dir: Path) -> Stub:
    bring_up(stub, smollm_dir)
    return stub


def test_execute_greedy_parity_with_mlx_lm_generate(
    smol_stub: Stub, chat_prompts: list[list[int]], reference: list[list[int]]
) -> None:
    epoch = smol_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    got = drive(smol_stub, epoch, chat_prompts, max_tokens=MAX_TOKENS)
    assert got == reference
    assert any(len(r) == MAX_TOKENS for r in reference)  # at least one ran the full length


def test_generate_answers_paris(smol_stub: Stub) -> None:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=QUESTIONS[0])],
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    text = ""
    last = None
    for message in smol_stub.Generate(request):
        text += message.text
        last = message
    assert "Paris" in text
    assert last is not None and last.finish_reason == pb.FINISH_REASON_EOS
    assert "<|im_end|>" not in text
