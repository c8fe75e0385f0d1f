"""The sweep's plot: throughput and latency against batch size, drawn with Pillow only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

PLOT_SIZE = (960, 600)
_BLUE, _ORANGE, _GREEN, _RED = (31, 119, 180), (230, 115, 0), (44, 160, 44), (214, 39, 40)
_INK, _GRID, _MUTED = (30, 30, 30), (225, 225, 225), (110, 110, 110)
Font = ImageFont.FreeTypeFont | ImageFont.ImageFont
# the right axis reaches no higher than this many times the highest median for anything else (a
# p90 far above every median, a latency budget far above the curve): the medians would flatten
HEADROOM = 1.5


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Ticks from 0 to at least ``high`` with a round step (1, 2, 2.5 or 5 times a power of ten)."""
    if not high > 0 or not math.isfinite(high):
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(math.ceil(high / step - 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:g}"


def knee_text(rec: dict[str, Any]) -> str:
    """The knee in words: a curve still rising at the largest size that ran has none, and that
    size is not called one (it is only where the sweep stopped)."""
    if rec["knee"] is None:
        return "knee: none"
    return f"knee: batch {rec['knee']}" if rec["knee_reached"] else f"no knee up to batch {rec['knee']}"


def knee_marks(rec: dict[str, Any]) -> list[tuple[int, str, tuple[int, int, int]]]:
    """The vertical marks: the knee (or the largest size, when no knee was reached) and the
    recommendation, as (batch, label, colour); one mark when they are the same size."""
    knee, chosen = rec["knee"], rec["max_batch"]
    knee_label = f"knee {knee}" if rec["knee_reached"] else f"no knee up to {knee}"
    if knee is not None and knee == chosen:
        both = f"knee = recommended {knee}" if rec["knee_reached"] else f"{knee_label}; recommended {knee}"
        return [(knee, both, _GREEN)]
    marks = [(knee, knee_label, _GREEN)] if knee is not None else []
    return marks + ([(chosen, f"recommended {chosen}", _MUTED)] if chosen is not None else [])


class _Chart:
    """Throughput (left axis) and median latency with p90 whiskers (right axis) on a log2 batch axis."""

    def __init__(self, report: dict[str, Any], size: tuple[int, int]) -> None:
        self.report, self.size = report, size
        self.image = Image.new("RGB", size, "white")
        self.draw = ImageDraw.Draw(self.image)
        self.title, self.body, self.small = (ImageFont.load_default(size=s) for s in (22, 16, 14))
        self.x0, self.x1, self.y0, self.y1 = 95, size[0] - 95, 110, size[1] - 110
        self.rows: list[dict[str, Any]] = report["sizes"]
        self.ok = [r for r in self.rows if r["status"] == "ok"]
        logs = [math.log2(r["batch_size"]) for r in self.rows] or [0.0]
        self.lo, self.hi = min(logs) - 0.4, max(logs) + 0.4
        self.budget: float | None = report["settings"]["latency_budget_ms"]
        self.tp_ticks = nice_ticks(max((r["throughput"] for r in self.ok), default=0.0))
        top = max((r["median_ms"] for r in self.ok), default=0.0)
        # a p90 far above every median (a stall) would flatten the medians: its whisker is clipped;
        # a budget far above them (10 s against medians of a millisecond) is said in words instead
        reach = HEADROOM * top
        budget = self.budget if self.budget is not None and self.budget <= reach else 0.0
        self.ms_ticks = nice_ticks(max([min(r["p90_ms"], reach) for r in self.ok] + [top, budget]))
        self.budget_on_axis = self.budget is not None and self.budget <= self.ms_ticks[-1]

    def x(self, batch: float) -> float:
        return self.x0 + (math.log2(batch) - self.lo) / (self.hi - self.lo) * (self.x1 - self.x0)

    def y(self, value: float, ticks: list[float]) -> float:
        return self.y1 - value / ticks[-1] * (self.y1 - self.y0)

    def text(self, xy: tuple[float, float], text: str, font: Font, fill: Any, anchor: str = "lt") -> None:
        """Text placed by a two-letter anchor (l/m/r, t/m/b), computed here so any font works."""
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=font)
        x = xy[0] - {"l": left, "m": (left + right) / 2, "r": right}[anchor[0]]
        y = xy[1] - {"t": top, "m": (top + bottom) / 2, "b": bottom}[anchor[1]]
        self.draw.text((x, y), text, font=font, fill=fill)

    def dashed(self, start: tuple[float, float], end: tuple[float, float], fill: Any) -> None:
        length = math.dist(start, end)
        for at in range(0, int(length), 10):
            ends = (at / length, min(at + 6, length) / length)
            self.draw.line(
                [(start[0] + (end[0] - start[0]) * t, start[1] + (end[1] - start[1]) * t) for t in ends], fill, 2
            )

    def marker(self, x: float, y: float, fill: Any, square: bool) -> None:
        (self.draw.rectangle if square else self.draw.ellipse)([x - 5, y - 5, x + 5, y + 5], fill=fill)

    def frame(self) -> None:
        """Title, grid, the three axes with ticks and titles."""
        report, rec, (width, _) = self.report, self.report["recommendation"], self.size
        heading = f"{report['model']} v{report['version']} on {report['device']} ({report['dtype']})"
        self.text((width / 2, 18), heading, self.title, _INK, "mt")
        summary = f"{knee_text(rec)}    recommended max batch: {rec['max_batch']}    torch {report['torch']}"
        if not report["memory"]["kind"].startswith("cuda"):
            summary += f", {report['host']['torch_threads']} CPU threads"
        if self.budget is not None and not self.budget_on_axis:
            summary += f"    latency budget {self.budget:g} ms: above the axis"
        self.text((width / 2, 50), summary, self.body, _MUTED, "mt")
        for i, tick in enumerate(self.tp_ticks):
            y = self.y1 - i / (len(self.tp_ticks) - 1) * (self.y1 - self.y0)
            self.draw.line([(self.x0, y), (self.x1, y)], _GRID, 1)
            self.text((self.x0 - 8, y), _label(tick), self.small, _BLUE, "rm")
        for tick in self.ms_ticks:
            y = self.y(tick, self.ms_ticks)
            self.draw.line([(self.x1, y), (self.x1 + 5, y)], _ORANGE, 2)
            self.text((self.x1 + 9, y), _label(tick), self.small, _ORANGE, "lm")
        for row in self.rows:
            x = self.x(row["batch_size"])
            self.draw.line([(x, self.y1), (x, self.y1 + 5)], _INK, 2)
            self.text((x, self.y1 + 9), str(row["batch_size"]), self.small, _INK, "mt")
        self.draw.rectangle([self.x0, self.y0, self.x1, self.y1], outline=_INK, width=2)
        self.text((self.x0 - 8, self.y0 - 12), "throughput (items/s)", self.body, _BLUE, "lb")
        self.text((self.x1 + 8, self.y0 - 12), "median latency (ms)", self.body, _ORANGE, "rb")
        self.text(((self.x0 + self.x1) / 2, self.y1 + 32), "batch size (log2 scale)", self.body, _INK, "mt")

    def marks(self) -> None:
        """The knee, the recommendation, the latency budget and any out-of-memory size."""
        rec = self.report["recommendation"]
        labels_from: float = self.y0 + 6  # where the vertical marks' labels start
        if self.budget is not None and self.budget_on_axis:
            y = self.y(self.budget, self.ms_ticks)
            self.dashed((self.x0, y), (self.x1, y), _ORANGE)
            label = f"latency budget {self.budget:g} ms"
            if y - self.y0 < 24:  # under the line (above it is the axis's title), the marks' labels under it
                self.text((self.x1 - 6, y + 4), label, self.small, _ORANGE, "rt")
                labels_from = y + 26
            else:
                self.text((self.x1 - 6, y - 4), label, self.small, _ORANGE, "rb")
        for i, (batch, label, colour) in enumerate(knee_marks(rec)):
            x = self.x(batch)
            self.dashed((x, self.y0), (x, self.y1), colour)
            right_half = x > (self.x0 + self.x1) / 2  # label on the side with room
            self.text(
                (x - 6 if right_half else x + 6, labels_from + 22 * i),
                label,
                self.small,
                colour,
                "rt" if right_half else "lt",
            )
        for row in (r for r in self.rows if r["status"] == "oom"):
            x, y = self.x(row["batch_size"]), self.y1 - 14
            self.draw.line([(x - 7, y - 7), (x + 7, y + 7)], _RED, 3)
            self.draw.line([(x - 7, y + 7), (x + 7, y - 7)], _RED, 3)
            self.text((x, y - 12), "out of memory", self.small, _RED, "rb")
        if not self.ok:
            self.text(((self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2), "no batch size ran", self.title, _RED, "mm")

    def curves(self) -> None:
        for r in self.ok:  # p90 whiskers under the lines
            x, median = self.x(r["batch_size"]), self.y(r["median_ms"], self.ms_ticks)
            p90 = max(self.y0, self.y(r["p90_ms"], self.ms_ticks))
            self.draw.line([(x, median), (x, p90)], _ORANGE, 2)
            if p90 > self.y0:
                self.draw.line([(x - 5, p90), (x + 5, p90)], _ORANGE, 2)
            else:  # clipped: an arrow head says it goes on
                self.draw.polygon([(x - 6, p90 + 9), (x + 6, p90 + 9), (x, p90)], fill=_ORANGE)
        for key, ticks, colour, square in (
            ("throughput", self.tp_ticks, _BLUE, False),
            ("median_ms", self.ms_ticks, _ORANGE, True),
        ):
            points = [(self.x(r["batch_size"]), self.y(r[key], ticks)) for r in self.ok]
            if len(points) > 1:
                self.draw.line(points, colour, 3, joint="curve")
            for x, y in points:
                self.marker(x, y, colour, square)

    def legend(self) -> None:
        """Under the axis title, where no curve can be."""
        x, y = float(self.x0), self.size[1] - 30
        for name, colour, square in (
            ("throughput, items/s (left axis)", _BLUE, False),
            ("median latency, ms; whisker = p90 (right axis)", _ORANGE, True),
        ):
            self.draw.line([(x, y), (x + 30, y)], colour, 3)
            self.marker(x + 15, y, colour, square)
            self.text((x + 38, y), name, self.body, _INK, "lm")
            x += 38 + self.draw.textlength(name, font=self.body) + 40


def plot(report: dict[str, Any], path: Path, size: tuple[int, int] = PLOT_SIZE) -> None:
    """Draw the report's curves into a PNG at ``path``."""
    chart = _Chart(report, size)
    chart.frame()
    chart.marks()
    chart.curves()
    chart.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    chart.image.save(path, format="PNG")


# ---- the command -------------------------------------------------------------------------
