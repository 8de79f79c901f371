"""Horizontal bar-chart panels drawn onto a `Canvas` (one PNG per run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.png import Canvas, Color

WORKER: Color = (52, 101, 164)
BASELINE: Color = (170, 170, 170)
TARGET: Color = (204, 0, 0)

_WIDTH = 1100
_LABEL_W = 420
_BAR_X = _LABEL_W + 10
_BAR_MAX = 520
_ROW = 26
_TITLE = 34
_GAP = 22


@dataclass
class Bar:
    label: str
    value: float | None
    text: str
    color: Color = WORKER


@dataclass
class Panel:
    title: str
    bars: list[Bar] = field(default_factory=list)
    target: float | None = None
    target_label: str = ""


def _panel_height(panel: Panel) -> int:
    return _TITLE + _ROW * len(panel.bars) + _GAP


def draw(title: str, subtitle: str, panels: list[Panel], path: Path) -> None:
    height = 70 + sum(_panel_height(p) for p in panels)
    canvas = Canvas(_WIDTH, height)
    canvas.text(12, 12, title, scale=3)
    canvas.text(12, 44, subtitle, color=(90, 90, 90), scale=2)
    y = 70
    for panel in panels:
        title_w = canvas.text(12, y + 8, panel.title, scale=2)
        if panel.target is not None:
            note = f"(dashed: target {panel.target_label})"
            canvas.text(24 + title_w, y + 8, note, color=TARGET, scale=2)
        top = y + _TITLE
        values = [b.value for b in panel.bars if b.value is not None]
        if panel.target is not None:
            values.append(panel.target)
        scale = _BAR_MAX / (max(values) * 1.05) if values and max(values) > 0 else 0.0
        for i, bar in enumerate(panel.bars):
            row = top + i * _ROW
            canvas.text(_LABEL_W - canvas.text_width(bar.label), row + 5, bar.label)
            length = int((bar.value or 0.0) * scale)
            canvas.rect(_BAR_X, row + 2, _BAR_X + max(length, 1), row + _ROW - 4, bar.color)
            canvas.text(_BAR_X + length + 8, row + 5, bar.text, color=(40, 40, 40))
        if panel.target is not None:
            x = _BAR_X + int(panel.target * scale)
            bottom = top + _ROW * len(panel.bars)
            for dash in range(top, bottom, 8):
                canvas.rect(x, dash, x + 2, min(dash + 5, bottom), TARGET)
        y += _panel_height(panel)
    canvas.save(path)
