"""Prompt token ids for the benchmarks, cut from one fixed English text."""

from __future__ import annotations

from typing import Any

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books faster than any scribe. Within fifty years, presses "
    "operated in more than two hundred European cities, and millions of volumes circulated "
    "among merchants, scholars and clergy. Prices fell, literacy rose, and ideas travelled "
    "across borders at a speed that had never been possible before. Scientists shared "
    "observations of the planets, physicians compared notes on anatomy, and reformers "
    "spread pamphlets that challenged powerful institutions. Printers standardised "
    "spelling and grammar, which slowly shaped the modern forms of many languages. "
    "Maps became more accurate as navigators corrected each edition, and musicians "
    "printed scores that others could perform far away. Newspapers appeared in the "
    "seventeenth century, bringing weekly reports of trade, war and politics to ordinary "
    "readers in coffee houses and taverns. Steam power, rotary presses and cheap paper "
    "later made daily papers affordable for almost everyone, and public libraries opened "
    "their doors to workers who wanted to educate themselves after long shifts in mills "
    "and factories. "
)
SHORT = "The capital of France is"


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def long_tokens(tokenizer: Any, count: int) -> list[int]:
    """Exactly `count` tokens of the fixed text (repeated as needed)."""
    base = encode(tokenizer, TEXT)
    out: list[int] = []
    while len(out) < count:
        out.extend(base)
    return out[:count]


def distinct_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens each."""
    base = encode(tokenizer, TEXT)
    step = max(1, min(length, (len(base) - length) // max(count, 1)))
    prompts = []
    for i in range(count):
        start = (i * step) % max(1, len(base) - length)
        prompts.append(base[start : start + length])
    return prompts
