"""The text calls (Tokenize, Detokenize) and Generate's entry point.

`GenerateCalls` takes the worker's core. The text calls need a loaded model
(a light sleep keeps it); `generate` validates on the caller's thread, then
opens the request's stream on the engine thread, where the runner holds the
request from then on and `scheduling.GenerateScheduler` runs its steps.
Invariants: a request is in the runner exactly while its stream is open; a
refused start leaves neither; cancelling frees the request on the engine
thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.core.generate import ChatMessage, GenerateChunk, GenerateSpec
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.engine import text
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.worker.core import WorkerCore
from mlx_worker_svc.worker.generation import GenerateStream

S = WorkerState


class GenerateCalls:
    """Tokenize, Detokenize and Generate over one worker core."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def require_tokenizer(self, call: str) -> None:
        """Text calls need a model; a light sleep (level 1) keeps it."""
        if self.core.state is S.SLEEPING:
            self.core.need_model(call)
        else:
            self.core.require(call, S.MODEL_LOADED)

    def tokenize_text(self, value: str, add_special_tokens: bool) -> list[int]:
        self.require_tokenizer("Tokenize")
        return text.encode_text(
            self.core.need_model().tokenizer, value, add_special_tokens=add_special_tokens
        )

    def tokenize_chat(
        self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, tools_json: str = ""
    ) -> tuple[list[int], str]:
        self.require_tokenizer("Tokenize")
        return text.render_chat(
            self.core.need_model().tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools_json=tools_json,
        )

    def detokenize(
        self, ids: list[int], skip_special_tokens: bool, *, token_bytes: bool = False
    ) -> tuple[str, list[bytes]]:
        """The text of `ids` and, with `token_bytes`, each token's own bytes."""
        self.require_tokenizer("Detokenize")
        loaded = self.core.need_model()
        for i, token in enumerate(ids):
            if not 0 <= token < loaded.info.vocab_size:
                raise InvalidArgument(
                    f"token_ids[{i}] = {token} is out of the vocabulary "
                    f"(size {loaded.info.vocab_size})"
                )
        decoded = text.decode(loaded.tokenizer, ids, skip_special_tokens=skip_special_tokens)
        return decoded, text.token_bytes(loaded.tokenizer, ids) if token_bytes else []

    def generate(self, spec: GenerateSpec) -> tuple[Iterator[GenerateChunk], Callable[[], None]]:
        """Starts a Generate request; returns its chunk iterator and a cancel."""
        core = self.core
        core.require("Generate", S.READY)
        self._check_model(spec.model)
        core.admit_requests("Generate", 1)  # fast path; the job decides
        prompt = self._generate_prompt(spec)
        request_id = spec.request_id or uuid.uuid4().hex
        core.compile_grammars(
            [(spec.sampling.structured_outputs, "sampling_params.structured_outputs")]
        )

        def job() -> GenerateStream:
            core.require("Generate", S.READY)
            self._check_model(spec.model)
            runner = core.need_runner("Generate")
            core.admit_requests("Generate", 1)
            if request_id in core.streams:
                raise InvalidArgument(f"request_id {clip(request_id)!r} is already streaming")
            runner.add_generate(
                request_id,
                tuple(prompt),
                spec.sampling,
                spec.lora_name,
                prompt_field=_prompt_field(spec),
            )
            stream = GenerateStream(
                request_id=request_id,
                prompt_tokens=len(prompt),
                text=runner.text_stream(skip_special_tokens=spec.skip_special_tokens),
            )
            core.streams.open(stream)
            core.metrics.prompt_tokens.inc(len(prompt))
            return stream

        stream = core.engine.call(job, bounded=True)

        def cancel() -> None:
            core.engine.submit(lambda: core.end_stream(request_id, None))

        return stream.chunks(), cancel

    def _check_model(self, asked: str) -> None:
        """Raises NotFound unless `asked` is empty or names the loaded model: as LoadModel
        gave it, the last component of its path, or the same path written another way
        ("m", "./m/" and its absolute path are one, as to LoadModel)."""
        held = self.core.load_spec.model if self.core.load_spec is not None else ""
        if not asked or asked in (held, held.rstrip("/").rsplit("/", 1)[-1]):
            return
        if not held or loader.local_path(asked) != loader.local_path(held):
            raise NotFound(
                f"model: this worker does not serve {clip(asked)!r}; it serves {held!r} "
                "(leave model empty for it)"
            )

    def _generate_prompt(self, spec: GenerateSpec) -> list[int]:
        forms = sum(bool(x) for x in (spec.prompt, spec.messages, spec.prompt_token_ids))
        if forms != 1:
            raise InvalidArgument(
                "Generate needs exactly one of prompt, messages or prompt_token_ids"
            )
        if spec.tools_json and not spec.messages:
            raise InvalidArgument("tools_json needs messages (a chat to render the tools into)")
        if spec.messages:
            return self.tokenize_chat(spec.messages, True, spec.tools_json)[0]
        if spec.prompt:
            return self.tokenize_text(spec.prompt, True)
        return list(spec.prompt_token_ids)


def _prompt_field(spec: GenerateSpec) -> str:
    """The request field a refusal of its prompt (too long, out of vocabulary) names."""
    if spec.prompt_token_ids:
        return "prompt_token_ids"
    return "messages (the prompt they render)" if spec.messages else "prompt"
