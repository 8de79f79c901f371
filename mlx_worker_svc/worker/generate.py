"""The text calls (Tokenize, Detokenize) and Generate, which the worker schedules itself.

Generate requests live in the runner beside Execute's, in their own id space;
between Execute steps the engine thread runs `_generate_step`, and inside an
Execute step they ride along when the step still fits (worker.Worker).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

from mlx_worker_svc.core.domain import ChatMessage, GenerateChunk, GenerateSpec, WorkerState
from mlx_worker_svc.core.errors import Internal, InvalidArgument, ResourceExhausted
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine import text
from mlx_worker_svc.worker.core import WorkerCore
from mlx_worker_svc.worker.generation import GenerateStream

S = WorkerState
# Generate prompts are prefilled in chunks of this many tokens per step, so a
# long prompt does not stall the requests decoding beside it.
GENERATE_PREFILL_CHUNK = 512


class GenerateMixin(WorkerCore):
    def _require_tokenizer(self, call: str) -> None:
        """Text calls need a model; a light sleep (level 1) keeps it."""
        if self._state is S.SLEEPING:
            self._need_model()
        else:
            self._require(call, S.MODEL_LOADED)

    def tokenize_text(self, value: str, add_special_tokens: bool) -> list[int]:
        self._require_tokenizer("Tokenize")
        return text.encode_text(
            self._need_model().tokenizer, value, add_special_tokens=add_special_tokens
        )

    def tokenize_chat(
        self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, tools_json: str = ""
    ) -> tuple[list[int], str]:
        self._require_tokenizer("Tokenize")
        return text.render_chat(
            self._need_model().tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools_json=tools_json,
        )

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        self._require_tokenizer("Detokenize")
        loaded = self._need_model()
        for i, token in enumerate(ids):
            if not 0 <= token < loaded.info.vocab_size:
                raise InvalidArgument(
                    f"token_ids[{i}] = {token} is out of the vocabulary "
                    f"(size {loaded.info.vocab_size})"
                )
        return text.decode(loaded.tokenizer, ids, skip_special_tokens=skip_special_tokens)

    def generate(self, spec: GenerateSpec) -> tuple[Iterator[GenerateChunk], Callable[[], None]]:
        """Starts a Generate request; returns its chunk iterator and a cancel."""
        self._require("Generate", S.READY)
        self._admit_requests("Generate", 1)  # fast path; the job decides
        prompt = self._generate_prompt(spec)
        request_id = spec.request_id or uuid.uuid4().hex
        self._compile_grammars(
            [(spec.sampling.structured_outputs, "sampling_params.structured_outputs")]
        )

        def job() -> GenerateStream:
            self._require("Generate", S.READY)
            runner = self._need_runner("Generate")
            self._admit_requests("Generate", 1)
            loaded = self._need_model()
            if request_id in self._streams:
                raise InvalidArgument(f"request_id {clip(request_id)!r} is already streaming")
            runner.add_generate(request_id, tuple(prompt), spec.sampling)
            skip = frozenset(loaded.info.eos_token_ids) if spec.skip_special_tokens else frozenset()
            stream = GenerateStream(
                request_id=request_id,
                prompt_tokens=len(prompt),
                text=text.TextStream(loaded.tokenizer, skip_ids=skip),
            )
            self._streams.open(stream)
            self.metrics.prompt_tokens.inc(len(prompt))
            return stream

        stream = self._engine.call(job, bounded=True)

        def cancel() -> None:
            self._engine.submit(lambda: self._end_stream(request_id, None))

        return stream.chunks(), cancel

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

    def _generate_pending(self) -> bool:
        return bool(self._streams) and self._runner is not None

    def _generate_step(self) -> None:
        runner = self._runner
        if runner is None or not self._streams:
            return
        work, starved = runner.internal_work(GENERATE_PREFILL_CHUNK)
        if starved:
            youngest = self._streams.ids()[-1]
            self._end_stream(
                youngest,
                ResourceExhausted("the KV budget is full; the request could not continue"),
            )
            return
        if not work.scheduled:
            return
        try:
            runner.check_memory(work, "the Generate step")
            self._run(runner, work)
        except ResourceExhausted as exc:
            # Shed the youngest stream; the others keep their state and retry.
            self._end_stream(self._streams.ids()[-1], exc)
        except Exception as exc:
            # No caller waits on this step: end the streams it carried with the
            # cause instead of letting the engine thread die for all requests.
            for _, request_id in work.scheduled:
                self._end_stream(request_id, Internal(f"Generate step failed: {exc!r}"))
