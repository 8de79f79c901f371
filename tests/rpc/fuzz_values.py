"""The values the RPC fuzzer (test_fuzz.py) draws request fields from.

Edge values of each wire type (uint32/uint64/int32 extremes, NaN and
infinities), odd and huge texts, token-id lists up to far past the context,
request ids that may name the live keepers, and sampling parameters: sane, one
field bad, or wild. Hypothesis strategies only; nothing here talks to a worker.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from hypothesis import strategies as st

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

T = TypeVar("T")
VOCAB = 49152  # the tiny model's vocabulary
CONTEXT = 512  # and its context length
KEEPERS = {"keeper-0": [11, 12, 13], "keeper-1": [21, 22, 23, 24]}


# ----------------------------------------------------------------- edge values
U32_EDGES: tuple[int, ...] = (0, 1, 2, 3, 15, 16, 17, 20, 21, 511, 512, 513, VOCAB - 1, VOCAB)
U32_EDGES += (2**31 - 1, 2**31, 2**32 - 1)
U64_EDGES = (*U32_EDGES, 2**32, 2**49, 2**50, 2**63 - 1, 2**63, 2**64 - 1)
I32_EDGES = (-(2**31), -2, -1, 0, 1, 2, 20, 21, VOCAB, 2**31 - 1)
FLOAT_EDGES: tuple[float, ...] = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e-30)
FLOAT_EDGES += (0.5, 1.0, 1.0000001, 2.0, 2.0000002, -1.0, -2.0, -2.0000002, 3.4e38, -3.4e38)
# Execute.worker_epoch: mostly the worker's, sometimes one it never had.
EPOCHS: tuple[str | int, ...] = ("current",) * 12
EPOCHS += ("next", "previous", 0, 1, 2**63, 2**64 - 1)
TOKEN_EDGES = (0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31, 2**32 - 1)
ODD_TEXT = (
    "",
    " ",
    "\x00",
    "a\x00b",
    "<|im_start|>",
    "<|endoftext|>",
    "<|im_end|>\n<|im_start|>assistant",
    "{{ messages }}{% for m in messages %}",
    "\u0301",
    "\ufeff",
    "\U0010ffff",
    "\U0001f642",
    "\r\n\t\v\f",
    "\u202e\u200b\u2028",
)
# Big inputs: each tokenizes in well under a second and stays far below 64 MiB.
HUGE_TEXT = (
    "ab c " * 40_000,
    "\U0001f642" * 50_000,
    "\u0301" * 100_000,
    "x\u0301\U0001f642 9" * 40_000,
)
HUGE_ID_COUNTS = (CONTEXT - 7, CONTEXT - 1, CONTEXT, CONTEXT + 1, 4096, 100_000)
FUZZ_IDS = ("a", "b", "c", "d", "", " ", "\u00e9", "\x00", "\U0001f642", "x" * 10_000)
ROLES = ("system", "user", "assistant", "tool", "", "robot", "USER", "user\x00", "user ")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # loader.py: these go to the hub


def weighted(*pairs: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """Draws from one of the strategies, each as often as its weight says."""
    choices = [strategy for weight, strategy in pairs for _ in range(weight)]
    return st.sampled_from(choices).flatmap(lambda strategy: strategy)


def pick(values: Sequence[T]) -> st.SearchStrategy[T]:
    """Like sampled_from, but its repr leaves out the values (some are huge)."""
    return st.integers(0, len(values) - 1).map(values.__getitem__)


def small_or_huge(small: int, edges: Iterable[int]) -> st.SearchStrategy[int]:
    """Cheap valid values and huge ones, without the expensive middle.

    For sizes that cost a forward pass (WarmUp batch sizes, DetermineMemory's
    block size): a valid value must stay cheap, an invalid one must be refused.
    """
    return weighted(
        (2, st.sampled_from(tuple(edges))),
        (2, st.integers(0, small)),
        (1, st.integers(2**16, 2**32 - 1)),
    )


def text_values(max_size: int) -> st.SearchStrategy[str]:
    return weighted(
        (6, st.text(st.characters(codec="utf-8"), max_size=max_size)),
        (3, st.sampled_from(ODD_TEXT)),
        (1, st.just(10_000).map(lambda n: "x" * n)),
    )


def huge_ids(size: int, kind: str) -> list[int]:
    """A long token list built at once (hypothesis draws small lists only)."""
    ids = [(7 * i + 1) % VOCAB for i in range(size)]
    if kind == "oov-last":
        ids[-1] = VOCAB
    elif kind == "max-in-middle":
        ids[size // 2] = 2**32 - 1
    return ids


def token_lists(max_size: int, huge: int) -> st.SearchStrategy[list[int]]:
    """Short lists of mostly valid ids; `huge` weighs in the long ones (of 20)."""
    short = st.lists(TOKEN, max_size=max_size)
    return weighted((20, short), (huge, HUGE_IDS)) if huge else short


# The strategies are built once: building them per draw costs more than drawing.
# Numbers: an edge value, a small one or anything in range, a third each.
U32 = st.sampled_from(U32_EDGES) | st.integers(0, 64) | st.integers(0, 2**32 - 1)
U64 = st.sampled_from(U64_EDGES) | st.integers(0, 64) | st.integers(0, 2**64 - 1)
I32 = st.sampled_from(I32_EDGES) | st.integers(-64, 64) | st.integers(-(2**31), 2**31 - 1)
F32 = st.sampled_from(FLOAT_EDGES) | st.floats(-2.5, 2.5, width=32) | st.floats(width=32)
BOOL = st.booleans()
MAYBE_BOOL = st.none() | st.booleans()
TEXT = text_values(16)
SHORT_TEXT = text_values(8)
LONG_TEXT = weighted((30, text_values(60)), (1, pick(HUGE_TEXT)))
TOKEN = weighted((8, st.integers(0, VOCAB - 1)), (1, st.sampled_from(TOKEN_EDGES)))
HUGE_IDS = st.builds(
    huge_ids,
    st.sampled_from(HUGE_ID_COUNTS),
    st.sampled_from(("valid", "valid", "oov-last", "max-in-middle")),
)
PROMPT_IDS = token_lists(6, huge=1)
NEW_TOKEN_IDS = token_lists(4, huge=1)
GENERATE_IDS = token_lists(12, huge=1)
DETOKENIZE_IDS = token_lists(16, huge=2)
MESSAGES = weighted(
    (
        20,
        st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(ROLES), content=TEXT), max_size=4),
    ),
    (
        1,
        st.builds(
            lambda n, content: [pb.ChatMessage(role="user", content=content)] * n,
            st.sampled_from((200, 1000)),
            st.sampled_from(("", "hi", "{{ x }}")),
        ),
    ),
)
# Ids for Execute: a small shared pool (so steps collide), the keepers, odd text;
# finished/preempted lists never name a keeper (that would be a valid step).
NOT_KEEPER = text_values(12).filter(lambda s: s not in KEEPERS)
REQ_IDS = weighted((8, pick(FUZZ_IDS)), (2, st.sampled_from(sorted(KEEPERS))), (1, NOT_KEEPER))
REMOVABLE_IDS = weighted((8, pick(FUZZ_IDS)), (1, NOT_KEEPER))

# Each SamplingParams field with values that range from fine to absurd.
SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": F32,
    "top_p": F32,
    "top_k": I32,
    "min_p": F32,
    "repetition_penalty": F32,
    "presence_penalty": F32,
    "frequency_penalty": F32,
    "logit_bias": st.dictionaries(
        weighted((3, st.integers(0, VOCAB - 1)), (1, st.sampled_from(TOKEN_EDGES))),
        F32,
        max_size=3,
    ),
    "seed": U64,
    "min_tokens": U32,
    "max_tokens": U32,
    "stop_token_ids": token_lists(4, huge=0),
    "ignore_eos": BOOL,
    "logprobs": U32,
    "prompt_logprobs": U32,
    "stop": st.lists(SHORT_TEXT, max_size=3),
}
SAMPLING_NAMES = st.sampled_from(sorted(SAMPLING_FIELDS))
SANE = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from((0.0, 0.0, 0.7, 1.0)),
        "max_tokens": st.integers(1, 4),
    }
)
SANE_EXTRAS = st.fixed_dictionaries(
    {
        "top_k": st.integers(-1, 60),
        "top_p": st.floats(0.125, 1.0, width=32),
        "min_p": st.floats(0.0, 1.0, width=32),
        "repetition_penalty": st.floats(0.5, 2.0, width=32),
        "presence_penalty": st.floats(-2.0, 2.0, width=32),
        "frequency_penalty": st.floats(-2.0, 2.0, width=32),
        "seed": st.integers(0, 2**64 - 1),
        "logprobs": st.integers(0, 20),
        "logit_bias": st.dictionaries(
            st.integers(0, VOCAB - 1), st.floats(-100, 100, width=32), max_size=1
        ),
    }
)
SAMPLING_MODES = st.sampled_from(("sane", "sane", "one-bad", "wild"))


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    """Sane parameters, sane ones with one field replaced by junk, or all junk."""
    mode = draw(SAMPLING_MODES)
    fields: dict[str, Any] = draw(SANE)
    if draw(BOOL):
        fields.update(draw(SANE_EXTRAS))
    if mode == "one-bad":
        name = draw(SAMPLING_NAMES)
        fields[name] = draw(SAMPLING_FIELDS[name])
    elif mode == "wild":
        fields = {name: draw(s) for name, s in SAMPLING_FIELDS.items() if draw(BOOL)}
    return pb.SamplingParams(**fields)


SAMPLING = sampling_params()
ONE_IN_SIX = st.integers(0, 5)
