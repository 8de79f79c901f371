"""NewRequest.detokenize: each RequestOutput carries the text its tokens add.

The pieces of a request concatenate to what Detokenize gives for its output
tokens; a continuation (num_generated_tokens) picks the text up where the
output streamed elsewhere left it, a held-back partial character included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver import greedy
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_worker_svc.client.execute_loop import LoopResult, run_prompts
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
# Random weights: the tokens are noise, which is what a detokenizer should survive
# (byte tokens that split characters, special tokens, runs of spaces).
PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [31000, 17, 4242, 12], [0, 2, 1, 2]]


def _run(
    stub: Stub,
    prompts: list[list[int]],
    *,
    skip: bool | None,
    chunk: int | None = None,
    decode_steps: int = 0,
    tokens: int = 40,
) -> LoopResult:
    epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        for new in request.new_requests:
            new.detokenize = True
            if skip is not None:
                new.skip_special_tokens = skip
        response: pb.ExecuteResponse = stub.Execute(request)
        return response

    params = greedy(tokens, ignore_eos=True)
    return run_prompts(execute, epoch, prompts, params, chunk=chunk, decode_steps=decode_steps)


def _detokenize(stub: Stub, ids: list[int], skip: bool) -> str:
    request = pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip)
    return str(stub.Detokenize(request).text)


@pytest.mark.parametrize(
    ("skip", "chunk", "decode_steps"),
    [(None, None, 0), (True, 2, 0), (False, None, 0), (None, 3, 4), (False, None, 8)],
    ids=["default", "skip-chunked", "keep-special", "chunked-4-steps", "keep-8-steps"],
)
def test_the_pieces_concatenate_to_detokenize(
    tiny_stub: Stub, skip: bool | None, chunk: int | None, decode_steps: int
) -> None:
    result = _run(tiny_stub, PROMPTS, skip=skip, chunk=chunk, decode_steps=decode_steps)
    for tokens, outputs in zip(result.tokens, result.outputs, strict=True):
        assert len(tokens) == 40
        text = "".join(o.text for o in outputs)
        assert text == _detokenize(tiny_stub, tokens, skip is not False)
        # Text arrives with the tokens, not all at the end.
        assert sum(bool(o.text) for o in outputs) > len(outputs) // 2
        assert outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_special_tokens_are_left_out_by_default(tiny_stub: Stub, smollm_dir: Path) -> None:
    """A chat marker the model emits is in the text only with skip_special_tokens false:
    every added token marked special, not only those `all_special_ids` names (SmolLM2's
    `<repo_name>` once stayed in the text)."""
    tokenizer = load_tokenizer(smollm_dir)
    added = tokenizer.added_tokens_decoder.items()
    special = sorted(int(i) for i, token in added if token.special)
    assert len(special) > len(tokenizer.all_special_ids)
    prompt = [5, 6, 7]
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    texts = {}
    for skip in (True, False):
        rid = f"special-{skip}"
        new = pb.NewRequest(
            req_id=rid,
            prompt_token_ids=prompt,
            sampling_params=greedy(8 + len(special), ignore_eos=True),
            detokenize=True,
            skip_special_tokens=skip,
        )
        first = tiny_stub.Execute(
            pb.ExecuteRequest(
                step_id=0,
                worker_epoch=epoch,
                new_requests=[new],
                num_scheduled_tokens={rid: len(prompt)},
            )
        ).outputs[0]
        # The scheduler splices special tokens in; they count as output.
        cached = pb.CachedRequest(
            req_id=rid, num_computed_tokens=first.num_computed_tokens, new_token_ids=special
        )
        second = tiny_stub.Execute(
            pb.ExecuteRequest(
                step_id=1,
                worker_epoch=epoch,
                cached_requests=[cached],
                num_scheduled_tokens={rid: 1 + len(special)},
            )
        ).outputs[0]
        output = [*first.sampled_token_ids, *special, *second.sampled_token_ids]
        texts[skip] = first.text + second.text
        assert texts[skip] == _detokenize(tiny_stub, output, skip)
    for token in special:
        name = tokenizer.convert_ids_to_tokens(token)
        assert name not in texts[True]
        assert name in texts[False]


def test_without_detokenize_there_is_no_text(tiny_stub: Stub) -> None:
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    result = run_prompts(tiny_stub.Execute, epoch, PROMPTS, greedy(16, ignore_eos=True))
    assert all(o.text == "" for outputs in result.outputs for o in outputs)
    assert all(len(tokens) == 16 for tokens in result.tokens)


def test_a_continuation_picks_the_text_up_where_it_was_left(tiny_stub: Stub) -> None:
    """Prompt + output elsewhere, num_generated_tokens: the output's text goes on, not again."""
    first = _run(tiny_stub, PROMPTS, skip=None, tokens=12)
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    for i, (prompt, done, outputs) in enumerate(
        zip(PROMPTS, first.tokens, first.outputs, strict=True)
    ):
        new = pb.NewRequest(
            req_id=f"continued-{i}",
            prompt_token_ids=[*prompt, *done],
            sampling_params=greedy(12, ignore_eos=True),
            num_generated_tokens=len(done),
            detokenize=True,
        )
        sampled, more = _to_the_end(tiny_stub, epoch, new)
        text = "".join(o.text for o in outputs) + "".join(o.text for o in more)
        assert text == _detokenize(tiny_stub, [*done, *sampled], True)


def _to_the_end(
    stub: Stub, epoch: int, new: pb.NewRequest
) -> tuple[list[int], list[pb.RequestOutput]]:
    """Runs one NewRequest to its end, a token a step: its sampled tokens and outputs."""
    rid, sampled, outputs = new.req_id, [], []
    step = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[new],
        num_scheduled_tokens={rid: len(new.prompt_token_ids)},
    )
    while True:
        out = stub.Execute(step).outputs[0]
        outputs.append(out)
        sampled.extend(out.sampled_token_ids)
        if out.finish_reason:
            return sampled, outputs
        cached = pb.CachedRequest(req_id=rid, num_computed_tokens=out.num_computed_tokens)
        step = pb.ExecuteRequest(
            step_id=step.step_id + 1,
            worker_epoch=epoch,
            cached_requests=[cached],
            num_scheduled_tokens={rid: 1},
        )


def test_a_character_split_across_a_failover_comes_out_whole(
    tiny_stub: Stub, smollm_dir: Path
) -> None:
    """The first byte of "e-acute" ended the output streamed elsewhere, held back there; the
    second byte, spliced in here, completes it: the text here starts with the character."""
    tokenizer = load_tokenizer(smollm_dir)
    lead, tail = (tokenizer.convert_tokens_to_ids(t) for t in ("\u00c3", "\u00a9"))  # C3, A9
    assert _detokenize(tiny_stub, [lead, tail], True) == "\u00e9"
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    rid = "split"
    new = pb.NewRequest(
        req_id=rid,
        prompt_token_ids=[5, 6, 7, lead],
        sampling_params=greedy(2, ignore_eos=True),
        num_generated_tokens=1,
        detokenize=True,
    )
    chunk = tiny_stub.Execute(
        pb.ExecuteRequest(worker_epoch=epoch, new_requests=[new], num_scheduled_tokens={rid: 3})
    ).outputs[0]
    assert (chunk.text, list(chunk.sampled_token_ids)) == ("", [])
    cached = pb.CachedRequest(req_id=rid, num_computed_tokens=3, new_token_ids=[tail])
    out = tiny_stub.Execute(
        pb.ExecuteRequest(
            step_id=1, worker_epoch=epoch, cached_requests=[cached], num_scheduled_tokens={rid: 2}
        )
    ).outputs[0]
    assert out.text.startswith("\u00e9")
    whole = _detokenize(tiny_stub, [lead, tail, *out.sampled_token_ids], True)
    assert out.text == whole[: len(out.text)]


def test_detokenize_gives_each_tokens_own_bytes(tiny_stub: Stub, smollm_dir: Path) -> None:
    """DetokenizeRequest.return_token_bytes: a piece of a character is its bytes alone."""
    text = "Hi 🌍 wörld 日本"
    ids = list(tiny_stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)
    eos = tiny_stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids[0]
    plain = tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))
    assert plain.text == text and not plain.token_bytes  # only when asked for
    ask = pb.DetokenizeRequest(token_ids=[*ids, eos], return_token_bytes=True)
    answer = tiny_stub.Detokenize(ask)
    assert len(answer.token_bytes) == len(ids) + 1
    assert b"".join(answer.token_bytes[:-1]) == text.encode()
    assert answer.token_bytes[-1] == b"<|im_end|>"  # special: its text, skipped or not
    alone = [tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=[t])).text for t in ids]
    split = [i for i, piece in enumerate(alone) if "\ufffd" in piece]
    assert split, "no character of the text is split over tokens"
    for i in split:
        with pytest.raises(UnicodeDecodeError):
            answer.token_bytes[i].decode()
    tokenizer = load_tokenizer(smollm_dir)
    for i, token in enumerate(ids):  # the tokenizer's own byte-level pieces, read back
        piece = tokenizer.convert_ids_to_tokens(token)
        assert len(answer.token_bytes[i]) == len(piece), (piece, answer.token_bytes[i])


def _generate(stub: Stub, params: pb.SamplingParams, skip: bool) -> tuple[list[int], str, int]:
    request = pb.GenerateRequest(prompt_token_ids=PROMPTS[2], sampling_params=params)
    request.skip_special_tokens = skip
    messages = list(stub.Generate(request))
    tokens = [t for m in messages for t in m.token_ids]
    return tokens, "".join(m.text for m in messages), messages[-1].finish_reason


def _execute(stub: Stub, params: pb.SamplingParams, skip: bool) -> tuple[list[int], str, int]:
    epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        for new in request.new_requests:
            new.detokenize, new.skip_special_tokens = True, skip
        response: pb.ExecuteResponse = stub.Execute(request)
        return response

    result = run_prompts(execute, epoch, [PROMPTS[2]], params)
    [tokens], [outputs] = result.tokens, result.outputs
    return tokens, "".join(o.text for o in outputs), outputs[-1].finish_reason


@pytest.mark.parametrize("run", [_generate, _execute], ids=["generate", "execute"])
def test_the_stop_token_that_ends_a_request_is_not_in_its_text(tiny_stub: Stub, run: Any) -> None:
    """As vLLM (include_stop_str_in_output false) and mlx-lm leave it out: a stop_token_ids
    token's text, and EOS's with skip_special_tokens false; its id is in token_ids."""
    free, _, _ = run(tiny_stub, greedy(12, ignore_eos=True), True)
    k = next(i for i in range(3, 12) if free[i] not in free[:i])
    stop = greedy(12, ignore_eos=True)
    stop.stop_token_ids.append(free[k])
    tokens, text, reason = run(tiny_stub, stop, True)
    assert tokens == free[: k + 1] and reason == pb.FINISH_REASON_STOP_TOKEN
    assert text == _detokenize(tiny_stub, tokens[:-1], True)
    assert text != _detokenize(tiny_stub, tokens, True)  # the stop token has a text
    eos = int(tiny_stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids[0])
    ended = greedy(12, min_tokens=3)
    ended.logit_bias[eos] = 100.0
    tokens, text, reason = run(tiny_stub, ended, False)
    assert len(tokens) == 4 and tokens[-1] == eos and reason == pb.FINISH_REASON_EOS
    assert text == _detokenize(tiny_stub, tokens[:-1], False)
    assert _detokenize(tiny_stub, [eos], False) not in text
