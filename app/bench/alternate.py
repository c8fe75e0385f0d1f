"""The summaries of ``scripts/bench_alternate.sh``: server variants measured in alternation.

Each round measures every variant one after the other, and each variant's throughput and CPU a
request are taken against the first variant's in the same round, so the host's drift between
rounds cancels. Latency is summed up the same way: the median over rounds of each lane's
percentiles, which is what an urgent-lane change is judged by (urgent p99 against normal p50).

``python -m app.bench.alternate round N ORDER LABEL=REPORT...``: one round's line.
``python -m app.bench.alternate summary OUT_DIR ROUNDS LABEL...``: the summary lines, and
``OUT_DIR/alternate.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.bench.loadgen.summary import EXPIRED, expired

Report = dict[str, Any]

# (lane, percentile) pairs summed up per variant: the urgent lane's tail, the normal lane's middle
# and tail, and how fast refusals came back (under RATE, at twice the load)
LATENCIES = (
    ("urgent", "p50_ms"),
    ("urgent", "p99_ms"),
    ("normal", "p50_ms"),
    ("normal", "p99_ms"),
    ("refused", "p99_ms"),
)


def _latency(report: Report, lane: str, percentile: str) -> float | None:
    """A lane's percentile, or None when the lane answered nothing in that run."""
    stats = report.get("latency", {}).get(lane, {})
    return float(stats[percentile]) if stats.get("count") else None


def _in_time(report: Report) -> tuple[float, float] | None:
    """Open loop with deadlines: the answers within their deadline by the client's clock, a second
    and as a share of the requests sent in the window; None in closed loop. A server that ignores
    deadlines (the rivals) and one that refuses what it cannot answer in time compare here."""
    if report.get("deadline_ms") is None or not report.get("sent_in_window"):
        return None
    in_time = report["ok"] - report["ok_past_deadline"]
    return in_time / report["measured_s"], in_time / report["sent_in_window"]


def _expired(report: Report) -> int | None:
    """Open loop with deadlines: the requests admitted and then answered 503 ``deadline_exceeded``
    (work taken on and not done in time); None in closed loop."""
    return None if report.get("deadline_ms") is None else expired(report)


def round_line(round_: int, runs: Sequence[tuple[str, Report]]) -> str:
    """One round: each variant's throughput, its share of the first's, its CPU a request, and
    its urgent p99 where the round had urgent answers."""
    base = runs[0][1]["throughput_rps"]
    parts = []
    for label, report in runs:
        rps = report["throughput_rps"]
        part = f"{label} {rps:.1f}/s ({rps / base:.3f}; {report['cpu']['server_ms_per_request']:.2f} ms CPU a request"
        if (expired := _expired(report)) is not None:
            part += f"; {expired} expired"
        urgent = _latency(report, "urgent", "p99_ms")
        parts.append(part + (f"; urgent p99 {urgent:.1f} ms)" if urgent is not None else ")"))
    return f"round {round_}: " + ", ".join(parts)


def summarize(reports: dict[str, list[Report]]) -> tuple[dict[str, Any], list[str]]:
    """Every variant against the first (``reports``' first key), round by round: the summary
    written to ``alternate.json`` and its lines."""
    base = next(iter(reports))
    rps = {label: [r["throughput_rps"] for r in runs] for label, runs in reports.items()}
    cpu = {label: [r["cpu"]["server_ms_per_request"] for r in runs] for label, runs in reports.items()}
    summary: dict[str, Any] = {}
    lines = []
    for label, runs in reports.items():
        ratios = [mine / theirs for mine, theirs in zip(rps[label], rps[base], strict=True)]
        cpu_ratios = [mine / theirs for mine, theirs in zip(cpu[label], cpu[base], strict=True)]
        latency: dict[str, dict[str, float]] = {}
        for lane, percentile in LATENCIES:
            values = [v for r in runs if (v := _latency(r, lane, percentile)) is not None]
            if values:
                latency.setdefault(lane, {})[percentile] = round(statistics.median(values), 1)
        in_time = [found for r in runs if (found := _in_time(r)) is not None]
        summary[label] = {
            "requests_per_s": rps[label],
            "median_rps": statistics.median(rps[label]),
            "ratio_to_first": [round(r, 3) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "cpu_ms_per_request": cpu[label],
            "median_cpu_ratio": round(statistics.median(cpu_ratios), 3),
            "median_latency_ms": latency,
        }
        if in_time:
            summary[label]["in_time_per_s"] = [round(rate, 2) for rate, _ in in_time]
            summary[label]["in_time_share"] = [round(share, 4) for _, share in in_time]
        expired = [count for r in runs if (count := _expired(r)) is not None]
        if expired:
            summary[label]["expired"] = expired
        lines.append(
            f"{label}: median {statistics.median(rps[label]):.1f} requests/s; against {base} in the same round: "
            f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
            f"CPU a request median {statistics.median(cpu_ratios):.3f} of {base}'s"
        )
        if in_time:
            lines.append(
                f"  {label} answered within the deadline: median {statistics.median(r for r, _ in in_time):.1f}/s, "
                f"{statistics.median(s for _, s in in_time):.3f} of the requests sent"
            )
        if expired:
            lines.append(
                f"  {label} admitted and expired ({EXPIRED}): {', '.join(map(str, expired))} a round, "
                f"{sum(expired)} in all"
            )
        if latency:
            said = "; ".join(
                f"{lane} "
                + "/".join(f"{value:g}" for value in by_percentile.values())
                + f" ({'/'.join(p.removesuffix('_ms') for p in by_percentile)})"
                for lane, by_percentile in latency.items()
            )
            lines.append(f"  {label} latency, median of the rounds, ms: {said}")
    return summary, lines


def _load(path: Path) -> Report:
    report: Report = json.loads(path.read_text())
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench.alternate", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("round", help="one round's line")
    one.add_argument("round", type=int)
    one.add_argument("order", help="the variants' labels, comma-separated, first the base")
    one.add_argument("reports", nargs="+", help="LABEL=REPORT, in any order")
    whole = commands.add_parser("summary", help="the summary of every round, and OUT_DIR/alternate.json")
    whole.add_argument("out", type=Path)
    whole.add_argument("rounds", type=int)
    whole.add_argument("labels", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "round":
        labels = args.order.split(",")
        pairs = [pair.split("=", 1) for pair in args.reports]
        runs = sorted(((label, _load(Path(path))) for label, path in pairs), key=lambda run: labels.index(run[0]))
        print(round_line(args.round, runs), flush=True)
        return 0
    reports = {
        label: [_load(args.out / f"{label}-{n}.json") for n in range(1, args.rounds + 1)] for label in args.labels
    }
    summary, lines = summarize(reports)
    print("\n".join(lines))
    (args.out / "alternate.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
