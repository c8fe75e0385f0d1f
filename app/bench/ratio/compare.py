"""Variants measured in interleaved rounds, side by side."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from app.bench.ratio.ends import EndLimit, end_limit
from app.bench.ratio.report import mean_batch

Run = tuple[str, dict[str, Any], dict[str, Any] | None]
"""A variant's label, one round's bench report, and the limit measured in that round (if any)."""


def compare(limit: dict[str, Any], runs: Sequence[Run]) -> dict[str, Any]:
    """Variants measured in interleaved rounds: per variant, the median of its rounds.

    A run with its round's own limit is divided by that one: the machine's speed drifts
    between rounds, and a ratio taken within a minute is steadier than one across the run.
    Each limit is taken as ``ratio report`` takes an end's (``ends.end_limit``: the formula, or
    what every core served in the same measurement where that was more).
    """
    headline = end_limit(limit)
    by_label: dict[str, list[tuple[dict[str, Any], EndLimit]]] = defaultdict(list)
    for label, bench, round_limit in runs:
        by_label[label].append((bench, end_limit(round_limit or limit)))
    rows = []
    for label, pairs in by_label.items():
        benches = [bench for bench, _ in pairs]
        rps = statistics.median(float(b["throughput_rps"]) for b in benches)
        ratios = [float(b["throughput_rps"]) / lim.images_per_s for b, lim in pairs]
        cpu_ratios = [
            lim.cpu_ms_per_image / float(b["cpu"]["server_ms_per_request"])
            for b, lim in pairs
            if b.get("cpu", {}).get("server_ms_per_request")
        ]
        server = [b["cpu"]["server_ms_per_request"] for b in benches if "server_ms_per_request" in b.get("cpu", {})]
        rows.append(
            {
                "variant": label,
                "rounds": len(benches),
                "throughput_rps": [b["throughput_rps"] for b in benches],
                "median_rps": round(rps, 1),
                "ratio": round(statistics.median(ratios), 4),
                "ratios": [round(r, 3) for r in ratios],
                "server_ms_per_request": round(statistics.median(server), 4) if server else None,
                "cpu_ratio": round(statistics.median(cpu_ratios), 4) if cpu_ratios else None,
                # null where the server's answers carry no batch size (a rival may send none)
                "mean_batch_size": round(statistics.median(sizes), 2) if (sizes := _sizes(benches)) else None,
                "p50_ms": round(statistics.median(b["latency"]["all"]["p50_ms"] for b in benches), 1),
                "other_cores": [b.get("cpu", {}).get("other_cores") for b in benches],
            }
        )
    round_limits: list[dict[str, Any]] = []  # each round's limit once, in order
    for _, _, round_limit in runs:
        if round_limit is not None and not any(round_limit is seen for seen in round_limits):
            round_limits.append(round_limit)
    return {
        "limit_images_per_s": headline.images_per_s,
        "limit_cpu_ms_per_image": round(headline.cpu_ms_per_image, 4),
        "limit_formula_images_per_s": headline.formula_images_per_s,
        "round_limits": [end_limit(r).images_per_s for r in round_limits],
        "round_limits_formula": [end_limit(r).formula_images_per_s for r in round_limits],
        "variants": rows,
    }


def compare_markdown(result: dict[str, Any]) -> str:
    """The variants as a markdown table, under the limit they were divided by."""
    formula = result.get("limit_formula_images_per_s", result["limit_images_per_s"])
    lines = [
        f"limit {result['limit_images_per_s']:.1f} images/s, {result['limit_cpu_ms_per_image']:.3f} ms CPU per image"
        + (
            f" (the formula read {formula:.1f}; raised to what every core served in the same measurement)"
            if formula < result["limit_images_per_s"]
            else ""
        )
        + (
            f"; per round: {', '.join(f'{v:.0f}' for v in result['round_limits'])}"
            if result.get("round_limits")
            else ""
        ),
        "",
        "| variant | requests/s (rounds) | ratio (rounds) | server CPU ms/req | CPU ratio | mean batch | p50 ms "
        "| other cores |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in result["variants"]:
        server = "-" if row["server_ms_per_request"] is None else f"{row['server_ms_per_request']:.3f}"
        cpu_ratio = "-" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.2f}"
        others = ", ".join("-" if o is None else f"{o:.2f}" for o in row["other_cores"])
        lines.append(
            f"| {row['variant']} | {row['median_rps']:.1f} ({', '.join(f'{r:.0f}' for r in row['throughput_rps'])}) "
            f"| {row['ratio']:.2f} ({', '.join(f'{r:.2f}' for r in row['ratios'])}) | {server} | {cpu_ratio} "
            f"| {mean_batch(row['mean_batch_size'])} | {row['p50_ms']:.0f} "
            f"| {others} |"
        )
    return "\n".join(lines)


def _sizes(benches: list[dict[str, Any]]) -> list[float]:
    """The runs' mean batch sizes, where their answers gave one."""
    return [b["mean_batch_size"] for b in benches if b.get("mean_batch_size") is not None]
