"""A run's report: throughput, latency percentiles per lane, errors, batch sizes, where the CPU
and memory went, and in open loop how far the client fell behind its schedule."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from app.bench.loadgen.loops import Run, Sample
from app.bench.loadgen.scrape import lag_report
from app.bench.loadgen.usage import cpu_report, memory_summary
from app.bench.threads import sched_report


# Not ``sweep.timing.percentile`` (interpolated, numpy's default) on purpose: a latency percentile
# of thousands of answers is one of them, a latency a request really had, and a lane that answered
# nothing reads 0 in the report; the sweep interpolates between its few passes per size and has no
# figure for no passes.
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not): the smallest value with at
    least ``q`` percent of them at or below it; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(round(q / 100 * len(ordered), 9))  # rounded: 0.07 * 100 is 7.000000000000001
    return ordered[max(1, min(len(ordered), rank)) - 1]


EXPIRED = "503:deadline_exceeded"  # what a request admitted and not computed by its deadline is answered


def expired(report: dict[str, Any]) -> int:
    """The requests a report's service admitted and then answered 503 ``deadline_exceeded``: work
    taken on and not done in time (a refusal at admission is ``would_miss_deadline``)."""
    return int(report.get("errors", {}).get(EXPIRED, 0))


LAG_WARNING_MS = 5.0  # open loop: a p99 send lag above this is the client's own delay, not the server's


def schedule_report(run: Run) -> dict[str, Any]:
    """Open loop: how late the client sent against its schedule (actual - scheduled send time,
    over the requests scheduled in the window), and the rate it really offered in the window
    (requests it sent in it, by the time it sent them). Latency counts from the scheduled
    arrival, so when the client falls behind (its own CPU the bottleneck) the lag is charged to
    the server as latency: these two say when that happened."""
    lags = [s.lag_s * 1000 for s in run.samples if s.counted and s.lag_s is not None]
    sent = sum(1 for s in run.samples if s.lag_s is not None and run.measured_from <= s.sent_at <= run.ended)
    return {
        "send_lag_ms": {
            "p50": round(percentile(lags, 50), 3),
            "p99": round(percentile(lags, 99), 3),
            "max": round(max(lags, default=0.0), 3),
        },
        "offered_rps": round(sent / max(1e-9, run.ended - run.measured_from), 2),
    }


def _lag_figures(report: dict[str, Any]) -> str:
    """The send lag's figures and the rate offered against the rate asked, as both lines give them."""
    lag, rate = report["send_lag_ms"], report.get("rate_rps")
    asked = "?" if rate is None else f"{rate:g}"
    return (
        f"p50 {lag['p50']:g}, p99 {lag['p99']:g}, max {lag['max']:g} ms; "
        f"offered {report['offered_rps']:g} of {asked} requests/s"
    )


def _late(report: dict[str, Any]) -> bool:
    return bool(report["send_lag_ms"]["p99"] > LAG_WARNING_MS)


def behind_schedule(report: dict[str, Any]) -> str | None:
    """A warning line when an open-loop client sent late enough to distort the latencies, else None."""
    if report.get("send_lag_ms") is None or not _late(report):
        return None
    return (
        f"warning: the client fell behind its schedule (send lag {_lag_figures(report)}): "
        "latency counts from the scheduled send, so the client's own lag reads as the server's latency"
    )


def schedule_line(report: dict[str, Any]) -> str:
    """For a report in markdown: how late the client sent against its schedule, and what it
    offered, with a warning past ``LAG_WARNING_MS`` at p99 (a closed loop has no schedule)."""
    if report.get("send_lag_ms") is None:
        return "- the client's send lag: none (a closed loop has no schedule)"
    line = f"- the client's send lag (its send against the scheduled arrival): {_lag_figures(report)}"
    if _late(report):
        line += (
            f" (**over {LAG_WARNING_MS:g} ms at p99**: latency counts from the scheduled send, so part of "
            "the figures above is the client's own delay)"
        )
    return line


# what each latency figure counts, written into the report beside them
LATENCY_BASIS = {
    "latency": (
        "answered requests only: all, urgent and normal over the successes (200), refused over the 503s; "
        "a request that failed, timed out or went unanswered is in none of them"
    ),
    "latency_sent": (
        "every request sent in the window: an answer (success or error) at its latency, a request the client "
        "gave up on (TimeoutError, unanswered) at no less than --timeout, another failure at its elapsed time"
    ),
}
GAVE_UP = ("TimeoutError", "unanswered")  # status 0 codes of requests still waiting when the client stopped


def sent_latency_s(sample: Sample, timeout_s: float | None) -> float:
    """What a request sent in the window counts for in ``latency_sent``: its latency, or, given up on
    by the client, no less than the client's ``timeout_s`` (it would have waited longer still)."""
    if sample.status == 0 and sample.code in GAVE_UP and timeout_s is not None:
        return max(sample.latency_s, timeout_s)
    return sample.latency_s


def failed_share_line(report: dict[str, Any]) -> str | None:
    """A warning when more than 1% of the requests sent in the window got no answer at all
    (timed out, unanswered, a connection failure): ``latency`` leaves them out, ``latency_sent`` not."""
    sent, lost = report.get("latency_sent", {}).get("count", 0), report.get("latency_sent", {}).get("without_answer", 0)
    if not sent or lost * 100 <= sent:
        return None
    answered = report["latency"]["all"]
    return (
        f"warning: {lost} of the {sent} requests sent in the window got no answer (timed out, unanswered or failed "
        f'in the client): "latency" counts answers only (p99 {answered["p99_ms"]:g} ms); over every request '
        f'sent, "latency_sent", p99 is {report["latency_sent"]["p99_ms"]:g} ms'
    )


def summarise(
    run: Run, settings: dict[str, Any], deadline_ms: float | None = None, timeout_s: float | None = None
) -> dict[str, Any]:
    """The report: throughput, latency percentiles per lane (answers, and 503 refusals) and over
    every request sent (``latency_sent``, the failed and given-up ones at their cost, at least
    ``timeout_s`` for those given up on), errors, mean batch size, answers later than their
    deadline, the server's memory, and in open loop how far the client fell behind its schedule."""
    counted = [s for s in run.samples if s.counted]
    ok = [s for s in counted if s.ok]
    refused = [s for s in counted if s.status == 503]
    window = max(1e-9, run.ended - run.measured_from)
    # answers that came inside the window, whenever sent: what the server got through in it
    answered = sum(1 for s in run.samples if s.ok and run.measured_from <= s.finished <= run.ended)

    def latencies(samples: list[Sample]) -> dict[str, float | int]:
        return latencies_of([s.latency_s * 1000 for s in samples])

    def latencies_of(values: list[float]) -> dict[str, float | int]:
        return {
            "count": len(values),
            "p50_ms": round(percentile(values, 50), 3),
            "p90_ms": round(percentile(values, 90), 3),
            "p99_ms": round(percentile(values, 99), 3),
            "max_ms": round(max(values, default=0.0), 3),
        }

    def mean_batch(samples: list[Sample]) -> float | None:
        # per batch, not per request: a batch of b holds b of the answers (the harmonic mean);
        # None where no answer said its batch size (a rival's): 0.0 read as batches of nothing
        sizes = [s.batch_size for s in samples if s.batch_size]
        return round(len(sizes) / sum(1 / b for b in sizes), 2) if sizes else None

    extra: dict[str, Any] = {}
    if any(s.timings_ms for s in ok):  # where each lane's time went, by the server's account
        extra["server_stages_ms"] = {
            lane: {
                stage: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3)}
                for stage in ("preprocess", "queue", "inference", "total")
                if (
                    v := [
                        float(s.timings_ms[stage])
                        for s in ok
                        if s.lane == lane and s.timings_ms and stage in s.timings_ms
                    ]
                )
            }
            for lane in ("urgent", "normal")
        }
    if run.cpu_before is not None and run.cpu_after is not None:
        extra["cpu"] = cpu_report(run.cpu_before, run.cpu_after, len(ok))
        if run.threads_before and run.threads_after:
            window_s = run.cpu_after["wall"] - run.cpu_before["wall"]
            extra["server_threads"] = sched_report(run.threads_before, run.threads_after, window_s)
    if deadline_ms is not None:  # the client's own clock: what it waited, beyond what it allowed
        extra["deadline_ms"] = deadline_ms
        extra["ok_past_deadline"] = sum(1 for s in ok if s.latency_s * 1000 > deadline_ms)
        # and the server's: its own total, from the request's first byte (where its deadline runs from)
        # to the answer built; the client's count adds the network, its own sending late, its reading
        if timed := [s.timings_ms["total"] for s in ok if s.timings_ms and "total" in s.timings_ms]:
            extra["ok_past_deadline_server"] = sum(1 for total in timed if float(total) > deadline_ms)
    if run.rss_mb:  # over the server's process tree, as its CPU is
        # RSS counts a page that n of the tree's processes share n times; for a server of one
        # process it is its VmRSS, comparable with earlier reports. PSS counts such a page once,
        # and is given where every reading had it (another user's server keeps it unreadable).
        extra["server_rss_mb"] = memory_summary(run.rss_mb)
        if len(run.pss_mb) == len(run.rss_mb):
            extra["server_pss_mb"] = memory_summary(run.pss_mb)
        extra["server_memory"] = {"processes": run.memory_processes}
    if ignored := Counter(name for s in ok for name in s.dropped):  # figures that could not be read
        extra["ignored_figures"] = dict(ignored)
    if run.lag_before is not None and run.lag_after is not None:
        extra["server_loop_lag"] = lag_report(run.lag_before, run.lag_after)
    if any(s.lag_s is not None for s in run.samples):
        extra.update(schedule_report(run))
    return {
        **settings,
        "measured_s": round(window, 3),
        "sent_with_warmup": run.sent,
        "sent_in_window": len(counted),
        "ok": len(ok),
        "throughput_rps": round(answered / window, 2),
        "latency": {
            "all": latencies(ok),
            "urgent": latencies([s for s in ok if s.lane == "urgent"]),
            "normal": latencies([s for s in ok if s.lane == "normal"]),
            "refused": latencies(refused),
        },
        "latency_sent": {
            **latencies_of([sent_latency_s(s, timeout_s) * 1000 for s in counted]),
            "without_answer": sum(1 for s in counted if s.status == 0),
        },
        "latency_basis": LATENCY_BASIS,
        "errors": dict(Counter(f"{s.status}:{s.code}" for s in counted if not s.ok)),
        "mean_batch_size": mean_batch(ok),
        "answers_with_batch_size": sum(1 for s in ok if s.batch_size),
        # by the lane each request asked for: a normal request that rode an urgent batch counts
        # that batch's size under normal (the answer does not say which lane its batch ran in);
        # null for a lane no answer (or none that said its batch size) came in
        "mean_batch_size_by_request_lane": {
            lane: mean_batch([s for s in ok if s.lane == lane]) for lane in ("urgent", "normal")
        },
        **extra,
    }
