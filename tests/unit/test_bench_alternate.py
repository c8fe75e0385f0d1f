"""The alternation's summaries: each variant against the first in the same round, latency by lane."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.bench.alternate import main, round_line, summarize


def report(rps: float, cpu_ms: float, urgent_p99: float | None = None, normal_p50: float = 60.0) -> dict[str, Any]:
    lanes: dict[str, Any] = {
        "urgent": {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0},
        "normal": {"count": 100, "p50_ms": normal_p50, "p99_ms": normal_p50 * 3},
        "refused": {"count": 0, "p50_ms": 0.0, "p99_ms": 0.0},
    }
    if urgent_p99 is not None:
        lanes["urgent"] = {"count": 10, "p50_ms": urgent_p99 / 3, "p99_ms": urgent_p99}
    return {"throughput_rps": rps, "cpu": {"server_ms_per_request": cpu_ms}, "latency": lanes}


def test_each_variant_is_taken_against_the_first_in_the_same_round() -> None:
    reports = {
        "base": [report(100, 4.0, 50), report(200, 4.0, 70), report(150, 5.0, 90)],
        "new": [report(110, 3.6, 30), report(180, 4.4, 40), report(165, 4.5, 200)],
    }
    summary, lines = summarize(reports)
    # the rounds' ratios, not the ratio of medians (165/150 and 110/100 against 180/200)
    assert summary["new"]["ratio_to_first"] == [1.1, 0.9, 1.1]
    assert summary["new"]["median_ratio"] == 1.1
    assert summary["new"]["median_cpu_ratio"] == 0.9
    assert summary["base"]["median_ratio"] == 1.0
    assert summary["new"]["median_latency_ms"]["urgent"] == {"p50_ms": 13.3, "p99_ms": 40.0}
    assert summary["new"]["median_latency_ms"]["normal"] == {"p50_ms": 60.0, "p99_ms": 180.0}
    assert "refused" not in summary["new"]["median_latency_ms"], "no refusals: no figure, not a zero"
    assert lines[2].startswith("new: median 165.0 requests/s; against base in the same round: median 1.100")
    assert "range 0.900-1.100" in lines[2]
    assert lines[3] == "  new latency, median of the rounds, ms: urgent 13.3/40 (p50/p99); normal 60/180 (p50/p99)"


def test_a_round_without_urgent_answers_leaves_them_out_of_the_medians() -> None:
    summary, _ = summarize({"only": [report(100, 4.0, None), report(100, 4.0, 80), report(100, 4.0, 20)]})
    assert summary["only"]["median_latency_ms"]["urgent"]["p99_ms"] == 50.0


def test_a_rounds_line_follows_the_variants_order_whichever_ran_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = {}
    for label, r in (("b", report(90, 5.0)), ("a", report(100, 4.0, 33.3))):
        paths[label] = tmp_path / f"{label}-1.json"
        paths[label].write_text(json.dumps(r))
    assert main(["round", "2", "a,b", f"b={paths['b']}", f"a={paths['a']}"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (
        "round 2: a 100.0/s (1.000; 4.00 ms CPU a request; urgent p99 33.3 ms), b 90.0/s (0.900; 5.00 ms CPU a request)"
    )
    assert round_line(2, [("a", report(100, 4.0, 33.3)), ("b", report(90, 5.0))]) == line


def test_the_summary_reads_every_round_and_writes_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for n, (a, b) in enumerate(((100, 120), (100, 80)), start=1):
        (tmp_path / f"a-{n}.json").write_text(json.dumps(report(a, 4.0, 30)))
        (tmp_path / f"b-{n}.json").write_text(json.dumps(report(b, 4.0, 60)))
    assert main(["summary", str(tmp_path), "2", "a", "b"]) == 0
    written = json.loads((tmp_path / "alternate.json").read_text())
    assert written["b"]["ratio_to_first"] == [1.2, 0.8]
    assert written["b"]["median_latency_ms"]["urgent"]["p99_ms"] == 60.0
    assert "b: median 100.0 requests/s" in capsys.readouterr().out


def test_open_loop_counts_the_answers_within_their_deadline_a_second_and_of_what_was_sent() -> None:
    """A server that refuses what it cannot answer in time and one that answers everything late
    compare by what came back in time, not by what came back."""

    def open_loop(rps: float, ok: int, late: int, sent: int) -> dict[str, Any]:
        extra = {"deadline_ms": 1000.0, "ok": ok, "ok_past_deadline": late, "sent_in_window": sent, "measured_s": 10.0}
        return {**report(rps, 4.0), **extra}

    summary, lines = summarize(
        {
            "refuses": [open_loop(400, 4000, 0, 8000), open_loop(380, 3800, 10, 8000)],
            "queues": [open_loop(450, 4500, 4200, 8000), open_loop(460, 4600, 4400, 8000)],
        }
    )
    assert summary["refuses"]["in_time_per_s"] == [400.0, 379.0]
    assert summary["refuses"]["in_time_share"] == [0.5, 0.4738]
    assert summary["queues"]["in_time_per_s"] == [30.0, 20.0]
    assert "  queues answered within the deadline: median 25.0/s, 0.031 of the requests sent" in lines
    closed, closed_lines = summarize({"closed": [report(100, 4.0)]})
    assert "in_time_per_s" not in closed["closed"] and not any("deadline" in line for line in closed_lines)


def test_open_loop_counts_the_admitted_requests_that_expired_each_round() -> None:
    """Work taken on and not done in time (503 ``deadline_exceeded``) is what an admission change is
    judged by, beside the answers: each round's line and the summary give it; closed loop has none."""

    def open_loop(rps: float, expired: int) -> dict[str, Any]:
        errors = {"503:would_miss_deadline": 900, "503:deadline_exceeded": expired} if expired else {}
        extra = {"deadline_ms": 1000.0, "ok": 10, "ok_past_deadline": 0, "sent_in_window": 20, "measured_s": 1.0}
        return {**report(rps, 4.0), **extra, "errors": errors}

    summary, lines = summarize({"old": [open_loop(350, 254), open_loop(360, 0)], "new": [open_loop(340, 0)] * 2})
    assert summary["old"]["expired"] == [254, 0] and summary["new"]["expired"] == [0, 0]
    assert "  old admitted and expired (503:deadline_exceeded): 254, 0 a round, 254 in all" in lines
    line = round_line(1, [("old", open_loop(350, 254)), ("new", open_loop(340, 0))])
    assert "(1.000; 4.00 ms CPU a request; 254 expired)" in line and "(0.971; 4.00 ms CPU a request; 0 expired)" in line
    closed, closed_lines = summarize({"closed": [report(100, 4.0)]})
    assert "expired" not in closed["closed"] and not any("expired" in text for text in closed_lines)
    assert "expired" not in round_line(1, [("closed", report(100, 4.0))])
