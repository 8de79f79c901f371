"""Horizontal bar-chart panels, one PNG per run, drawn with matplotlib.

A `Panel` is one question (a speed, a latency) with one `Bar` per measured
path, the worker's in one colour and its baselines in another, and an
optional dashed target line. `draw` stacks the panels into one figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

WORKER = "#3465a4"
BASELINE = "#aaaaaa"
TARGET = "#cc0000"


@dataclass
class Bar:
    label: str
    value: float | None
    text: str
    color: str = WORKER


@dataclass
class Panel:
    title: str
    bars: list[Bar] = field(default_factory=list)
    target: float | None = None
    target_label: str = ""


def draw(title: str, subtitle: str, panels: list[Panel], path: Path) -> None:
    """Writes `panels` (top to bottom) as one PNG at `path`."""
    rows = [max(len(p.bars), 1) for p in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, 1.2 + 0.32 * sum(rows) + 0.55 * len(panels)),
        gridspec_kw={"height_ratios": rows},
        squeeze=False,
    )
    fig.suptitle(f"{title}\n{subtitle}", x=0.01, ha="left", fontsize=11)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        labels = [b.label for b in panel.bars]
        values = [b.value or 0.0 for b in panel.bars]
        ax.barh(labels, values, color=[b.color for b in panel.bars], height=0.7)
        ax.invert_yaxis()  # first bar on top
        for i, bar in enumerate(panel.bars):
            ax.annotate(
                bar.text,
                (values[i], i),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        heading = panel.title
        if panel.target is not None:
            ax.axvline(panel.target, color=TARGET, linestyle="--", linewidth=1.2)
            heading += f"  (dashed: target {panel.target_label})"
        ax.set_title(heading, loc="left", fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        ax.tick_params(axis="x", labelsize=7)
        top = max([*values, panel.target or 0.0])
        ax.set_xlim(0, top * 1.3 if top > 0 else 1)
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
