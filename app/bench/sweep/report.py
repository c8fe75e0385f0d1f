"""The sweep's JSON report and its markdown table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from app.bench.chart import knee_text
from app.bench.sweep.knee import NEAR_BEST, Recommendation
from app.bench.sweep.memory import CudaMemory
from app.bench.sweep.timing import SizeResult

MIB = 2**20


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table with a heading and the recommendation."""
    cuda = report["memory"]["kind"] == CudaMemory.kind
    memory_columns = (
        ("peak alloc MiB", "peak reserved MiB") if cuda else ("peak RSS above post-load baseline MiB", "peak RSS MiB")
    )
    memory_keys = (
        ("peak_allocated_bytes", "peak_reserved_bytes") if cuda else ("peak_above_baseline_bytes", "peak_rss_bytes")
    )
    rec = report["recommendation"]
    lines = [
        f"## sweep: {report['model']} v{report['version']} on {report['device']} ({report['dtype']})",
        "",
        "| batch | iters | median ms | p90 ms | items/s | " + " | ".join(memory_columns) + " | note |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    knee_note = "knee" if rec["knee_reached"] else "no knee up to here"
    for row in report["sizes"]:
        size = row["batch_size"]
        notes = [
            word for word, hit in ((knee_note, size == rec["knee"]), ("recommended", size == rec["max_batch"])) if hit
        ]
        if row["status"] == "oom":
            lines.append(f"| {size} | - | - | - | - | - | - | OUT OF MEMORY |")
            continue
        mem = " | ".join(f"{row['memory'].get(key, 0) / MIB:.1f}" for key in memory_keys)
        lines.append(
            f"| {size} | {row['iterations']} | {row['median_ms']:.3f} | {row['p90_ms']:.3f} | "
            f"{row['throughput']:.1f} | {mem} | {', '.join(notes)} |"
        )
    lines += [
        "",
        f"memory: {report['memory']['description']}",
        f"{knee_text(rec)}; recommended max batch: {rec['max_batch']} ({rec['reason']})",
    ]
    if (near := rec.get("near_best_batch")) is not None and near != rec["knee"]:
        best = max(row["throughput"] for row in report["sizes"] if row["status"] == "ok")
        lines.append(
            f"near the best: batch {near} reaches {NEAR_BEST:.0%} of the best throughput measured ({best:.1f} items/s)"
        )
    return "\n".join(lines)


def build_report(meta: dict[str, Any], results: Sequence[SizeResult], rec: Recommendation) -> dict[str, Any]:
    """The JSON report: the run's facts, every size, and the recommendation."""
    return {**meta, "sizes": [asdict(r) for r in results], "recommendation": asdict(rec)}
