"""The ratio report: the service's throughput at saturation as a share of the in-process limit,
beside the service with no HTTP and behind the least HTTP, and its markdown summary."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from app.bench.loadgen.scrape import lag_line
from app.bench.ratio.ends import end_limit
from app.bench.threads import threads_text


def saturation(benches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The bench with the highest throughput."""
    return max(benches, key=lambda b: float(b["throughput_rps"]))


def build_report(
    limit: dict[str, Any],
    benches: Sequence[dict[str, Any]],
    profile: dict[str, Any] | None,
    config: dict[str, str],
    limit_after: dict[str, Any] | None = None,
    core: dict[str, Any] | None = None,
    floor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ratio at saturation and everything needed to read it.

    With ``limit_after`` (the limit measured again after the service), the ratio is taken
    against the mean of the two: these machines drift while a run goes on. With ``core``
    (``ai-backend core``: the same service driven in process, no HTTP), the report gives what
    the HTTP layer keeps of it; with ``floor`` (an ``ai-backend bench`` report against
    ``ai-backend floor``: the same service behind the least HTTP possible), what HTTP itself
    keeps and what the serving layers on top of it keep.
    """
    best = saturation(benches)
    ends = [limit] if limit_after is None else [limit, limit_after]
    limits = [end_limit(end) for end in ends]
    floored = [lim.images_per_s for lim in limits]
    images_per_s = statistics.mean(floored)
    limit_ms = statistics.mean(lim.cpu_ms_per_image for lim in limits)
    cpu = best.get("cpu", {})
    server_ms = cpu.get("server_ms_per_request")
    report: dict[str, Any] = {
        "config": config,
        "limit_images_per_s": round(images_per_s, 1),
        "limit_cpu_ms_per_image": round(limit_ms, 4),
        "limit_runs_images_per_s": [round(rate, 1) for rate in floored],
        # the formula's own figures, where a run of the same end served more (see end_limit)
        "limit_formula_images_per_s": [lim.formula_images_per_s for lim in limits],
        "limit_best_batch": limit["limit"]["best_batch"],
        "saturation": {
            "concurrency": best.get("concurrency"),
            "urgent_fraction": best.get("urgent_fraction", 0.0),
            "throughput_rps": best["throughput_rps"],
            "ratio": round(float(best["throughput_rps"]) / images_per_s, 4),
            # against each end alone: how far the host's drift over the run moves the ratio
            "ratio_by_end": [round(float(best["throughput_rps"]) / rate, 4) for rate in floored],
            "mean_batch_size": best["mean_batch_size"],
            "latency": best["latency"],
            "errors": best["errors"],
            "cpu": cpu,
            **({"server_loop_lag": best["server_loop_lag"]} if "server_loop_lag" in best else {}),
        },
        "sweep": [
            {
                "concurrency": b.get("concurrency"),
                "throughput_rps": b["throughput_rps"],
                "ratio": round(float(b["throughput_rps"]) / images_per_s, 4),
                "mean_batch_size": b["mean_batch_size"],
                "p50_ms": b["latency"]["all"]["p50_ms"],
                "p99_ms": b["latency"]["all"]["p99_ms"],
                "server_ms_per_request": b.get("cpu", {}).get("server_ms_per_request"),
                "other_cores": b.get("cpu", {}).get("other_cores"),
            }
            for b in benches
        ],
    }
    # every core at once with no serving layer: the machine's own ceiling, one process per core
    # (``every_core``), and in one process, a thread per core sharing the GIL (``every_thread``)
    for name in ("every_core", "every_thread"):
        runs = [float(end["limit"][f"{name}_images_per_s"]) for end in ends if f"{name}_images_per_s" in end["limit"]]
        if runs:
            report[f"{name}_images_per_s"] = round(statistics.mean(runs), 1)
            report[f"{name}_runs_images_per_s"] = runs
            report["saturation"][f"{name}_ratio"] = round(float(best["throughput_rps"]) / statistics.mean(runs), 4)
    if core is not None:
        report["core"] = core
        report["core_ratio"] = round(float(core["throughput_rps"]) / images_per_s, 4)
        report["saturation"]["http_ratio"] = round(float(best["throughput_rps"]) / float(core["throughput_rps"]), 4)
    if floor is not None:
        report["floor"] = {k: floor[k] for k in ("throughput_rps", "cpu", "errors") if k in floor}
        report["floor_ratio"] = round(float(floor["throughput_rps"]) / images_per_s, 4)
        report["saturation"]["floor_http_ratio"] = round(
            float(best["throughput_rps"]) / float(floor["throughput_rps"]), 4
        )
    if server_ms:
        # the serving layer's cost in CPU, whatever else ran on the machine meanwhile
        report["saturation"]["cpu_ratio"] = round(limit_ms / float(server_ms), 4)
        report["saturation"]["overhead_cpu_ms_per_request"] = round(float(server_ms) - limit_ms, 4)
    if profile is not None:
        report["profile"] = profile
    return report


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the ratio, the sweep, and where the CPU went."""
    sat = report["saturation"]
    cpu = sat.get("cpu", {})
    by_end = sat.get("ratio_by_end", [])
    formula = report.get("limit_formula_images_per_s", report["limit_runs_images_per_s"])
    runs = zip(formula, report["limit_runs_images_per_s"], strict=False)
    raised = [f"{f:.1f} by the formula" for f, v in runs if v > f]
    lines = [
        f"## service / limit: {sat['ratio']:.2f}"
        + (f" (against each end of the run alone: {', '.join(f'{r:.2f}' for r in by_end)})" if len(by_end) > 1 else ""),
        "",
        f"- limit: {report['limit_images_per_s']:.1f} images/s ({report['limit_cpu_ms_per_image']:.3f} ms CPU "
        f"per image; measured "
        f"{' and '.join(f'{v:.1f}' for v in report['limit_runs_images_per_s'])}"
        + (
            f"; raised to what every core served in the same measurement where that was more: {', '.join(raised)}"
            if raised
            else ""
        )
        + ")",
        f"- service at saturation (concurrency {sat['concurrency']}, {sat.get('urgent_fraction', 0.0):.0%} urgent): "
        f"{sat['throughput_rps']:.1f} requests/s, "
        f"mean batch {mean_batch(sat['mean_batch_size'])}",
    ]
    lines += _ceilings(report)
    if "core" in report:
        core = report["core"]
        lines.append(
            f"- the same service with no HTTP in front (in process, {core['concurrency']} clients, base64 text "
            f"straight to it): {core['throughput_rps']:.1f} requests/s ({report['core_ratio']:.2f} of the limit), "
            f"{core['cpu']['ms_per_request'] or 0:.3f} ms CPU per request ({threads_text(core)}); "
            f"**service / no HTTP: {sat['http_ratio']:.2f}**"
        )
    if "floor" in report:
        floor_ms = report["floor"].get("cpu", {}).get("server_ms_per_request")
        lines.append(
            f"- the same service behind the least HTTP possible (`ai-backend floor`: httptools, json.loads; no ids, "
            f"metrics or logs): {report['floor']['throughput_rps']:.1f} requests/s ({report['floor_ratio']:.2f} "
            f"of the limit)"
            + (f", {floor_ms:.3f} ms CPU per request" if floor_ms else "")
            + (f", errors {report['floor']['errors']}" if report["floor"].get("errors") else "")
            + f"; **service / least HTTP: {sat['floor_http_ratio']:.2f}**"
        )
    if "cpu_ratio" in sat:
        lines.append(
            f"- server CPU per request {cpu['server_ms_per_request']:.3f} ms: the limit's per-image CPU is "
            f"{sat['cpu_ratio']:.2f} of it ({sat['overhead_cpu_ms_per_request']:+.3f} ms of serving layer)"
        )
    if cpu:
        lines.append(
            f"- cores in the window: server {cpu.get('server_cores', 0):.2f}, client {cpu.get('client_cores', 0):.2f}, "
            f"other processes {cpu.get('other_cores', 0):.2f}, stolen {cpu.get('steal_cores', 0):.2f}"
        )
    if "server_loop_lag" in sat:
        lines.append(lag_line(sat["server_loop_lag"]))
    lines += ["", "| lane | requests | p50 ms | p90 ms | p99 ms |", "| --- | ---: | ---: | ---: | ---: |"]
    for lane in ("all", "normal", "urgent"):
        lat = sat["latency"][lane]
        if lat["count"]:
            lines.append(
                f"| {lane} | {lat['count']} | {lat['p50_ms']:.1f} | {lat['p90_ms']:.1f} | {lat['p99_ms']:.1f} |"
            )
    lines += [
        "",
        "| concurrency | requests/s | ratio | mean batch | p50 ms | p99 ms | server CPU ms/req | other cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["sweep"]:
        server = row["server_ms_per_request"]
        other = row["other_cores"]
        lines.append(
            f"| {row['concurrency']} | {row['throughput_rps']:.1f} | {row['ratio']:.2f} "
            f"| {mean_batch(row['mean_batch_size'])} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f} "
            f"| {'-' if server is None else f'{server:.3f}'} | {'-' if other is None else f'{other:.2f}'} |"
        )
    profile = report.get("profile")
    if profile:
        rps = float(profile.get("throughput_rps") or sat["throughput_rps"])
        lines += [
            "",
            f"### where the server's CPU goes ({profile['window_s']:.0f} s profile, {profile['cores']:.2f} cores, "
            f"{rps:.0f} requests/s)",
            "",
            "| thread group | cores | CPU ms/request | stages (share of the group's samples) |",
            "| --- | ---: | ---: | --- |",
        ]
        for group in profile["groups"]:
            if group["cores"] < 0.005:
                continue
            stages = ", ".join(f"{s['name']} {s['share']:.0%}" for s in group["stages"][:6]) or "(no Python frames)"
            lines.append(f"| {group['group']} | {group['cores']:.3f} | {group['cores'] / rps * 1000:.3f} | {stages} |")
    if report["config"]:
        lines += ["", "config: " + ", ".join(f"`{k}={v}`" for k, v in sorted(report["config"].items()))]
    return "\n".join(lines)


def _ceilings(report: dict[str, Any]) -> list[str]:
    """The lines of every core at once: in processes, and in one process with a thread per core."""
    sat, limit, lines = report["saturation"], report["limit_images_per_s"], []
    if "every_core_ratio" in sat:
        lines.append(
            f"- every core at once with no serving layer: {report['every_core_images_per_s']:.1f} images/s "
            f"({report['every_core_images_per_s'] / limit:.2f} of the limit); "
            f"**service / every core: {sat['every_core_ratio']:.2f}**"
        )
    if "every_thread_ratio" in sat:
        threads = report["every_thread_images_per_s"]
        processes = report.get("every_core_images_per_s")
        core = report.get("core")
        lines.append(
            f"- the same in one process, a thread per core sharing the GIL: {threads:.1f} images/s "
            f"({threads / limit:.2f} of the limit"
            + (f", {threads / processes:.2f} of the processes'" if processes else "")
            + f"); **service / every core in one process: {sat['every_thread_ratio']:.2f}**"
            + (f", its core with no HTTP {float(core['throughput_rps']) / threads:.2f}" if core else "")
        )
    return lines


def mean_batch(size: float | None) -> str:
    """A mean batch size; '-' where no answer gave one (none came back, or a rival's answers carry none)."""
    return "-" if size is None else f"{size:.1f}"
