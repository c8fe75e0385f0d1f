"""The service's throughput at saturation as a share of the in-process limit, and where the rest goes.

``python -m app.bench.ratio profile --pid PID``: records a running server with py-spy and
reads every thread's CPU time from ``/proc`` over the same window. The CPU per thread
group (event loop, decode pool, device thread, native threads such as OpenMP's) is exact;
py-spy's samples split each group's CPU between functions ("own" time: the leaf frame)
and between stages (the deepest frame that names one, see ``STAGES``).

``python -m app.bench.ratio report``: joins ``ai-backend limit``'s report, the closed-loop
bench reports (the best throughput is the saturation point) and the profile into one JSON
and a markdown summary. ``scripts/bench_ratio.sh`` runs the whole thing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.threads import group_name, thread_cpu, threads_text

# (stage, substrings of a frame "function (file)"); a sample goes to the deepest frame that matches
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base64 decode", ("b64decode", "a2b_base64", "base64_bytes")),
    ("JSON body parse", ("model_validate_json",)),
    ("JPEG decode", ("ImageFile.load", "JpegImagePlugin")),
    ("resize", ("Image.resize",)),
    ("other image work (open, convert, to tensor)", ("PIL/", "preprocess.py", "numpy/")),
    ("model forward", ("torch/nn/modules", "LayeredModel.", "runner.py")),
    ("tracing (OpenTelemetry)", ("opentelemetry", "TracedRunner")),
    ("logging", ("/logging/", "telemetry/logging.py")),
    ("metrics (Prometheus)", ("prometheus_client", "telemetry/metrics.py", "batching/observer.py")),
    ("batcher", ("app/batching/",)),
    (
        "thread hand-offs (pool, futures)",
        ("concurrent/futures", "asyncio/futures.py", "run_in_executor", "threading.py"),
    ),
    ("response model + JSON", ("serialize_response", "jsonable_encoder", "responses.py", "pydantic/")),
    ("dependencies", ("fastapi/dependencies",)),
    ("HTTP protocol (uvicorn, httptools)", ("uvicorn/protocols",)),
    ("routing + middleware (Starlette, FastAPI)", ("starlette/", "fastapi/", "app/api/")),
    ("app service", ("app/service.py", "app/inference/")),
    ("asyncio tasks", ("asyncio/",)),
)


# Leaf frames of a thread blocked in C (a queue, a lock, epoll): py-spy cannot always tell
# that such a thread is idle, so its samples are counted apart and left out of the shares.
# uvloop's loop is all C: its own I/O work lands here too, with its waiting.
IDLE_LEAVES = (
    "_worker (",  # concurrent.futures: waiting for work
    "WorkerThreads._work (",  # the decode pool and the device threads: waiting for work
    "Condition.wait (",
    "Event.wait (",
    "Thread.join (",
    "Runner.run (",  # uvloop's run loop (epoll and its C-level I/O)
)


def is_idle(frames: Sequence[str]) -> bool:
    return bool(frames) and frames[-1].startswith(IDLE_LEAVES)


@dataclass(frozen=True)
class Sample:
    tid: int
    thread: str
    frames: tuple[str, ...]  # outermost first
    count: int


_THREAD = re.compile(r"^thread \((0x[0-9a-fA-F]+|[0-9]+)\): ?(.*)$")


def parse_collapsed(text: str) -> list[Sample]:
    """py-spy's ``--format raw --threads`` output: ``thread (TID): NAME;frame;...;frame COUNT`` a line."""
    samples = []
    for line in text.splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        first, *frames = stack.split(";")
        match = _THREAD.match(first)
        if match is None or not count.isdigit():
            raise ValueError(f"not a py-spy raw line with thread ids: {line[:100]!r}")
        samples.append(Sample(int(match.group(1), 0), match.group(2), tuple(frames), int(count)))
    return samples


def short(frame: str) -> str:
    """``func (/long/path/site-packages/pkg/mod.py)`` as ``func (pkg/mod.py)``."""
    return re.sub(r"\((?:[^()]*/(?:site-packages|lib/python3\.\d+)/|[^()]*?/(?=app/))", "(", frame)


def stage_of(frames: Sequence[str]) -> str:
    """The stage of the deepest frame that names one; else the leaf function."""
    for frame in reversed(frames):
        for stage, needles in STAGES:
            if any(needle in frame for needle in needles):
                return stage
    return f"other: {short(frames[-1]) if frames else '?'}"


def summarise_profile(
    samples: Sequence[Sample],
    cpu_before: dict[int, tuple[str, float]],
    cpu_after: dict[int, tuple[str, float]],
    window_s: float,
    top: int = 12,
) -> dict[str, Any]:
    """Per thread group: cores used (``/proc``), and its CPU split by stage and by function (py-spy).

    Shares are of the group's busy samples (``IDLE_LEAVES`` apart).
    """
    names = {s.tid: group_name(s.thread) for s in samples}
    cores: dict[str, float] = defaultdict(float)
    tids: dict[str, list[int]] = defaultdict(list)
    for tid, (comm, after) in cpu_after.items():
        group = names.get(tid, f"native ({comm})")
        cores[group] += (after - cpu_before.get(tid, (comm, 0.0))[1]) / window_s
        tids[group].append(tid)
    stages: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    idle: Counter[str] = Counter()
    for s in samples:
        group = names[s.tid]
        if is_idle(s.frames):
            idle[group] += s.count
            continue
        stages[group][stage_of(s.frames)] += s.count
        own[group][short(s.frames[-1]) if s.frames else "?"] += s.count
    groups = []
    for group in sorted(cores, key=lambda g: -cores[g]):
        total = sum(stages[group].values())

        def shares(counter: Counter[str], total: int = total) -> list[dict[str, Any]]:
            return [{"name": name, "share": round(n / total, 4)} for name, n in counter.most_common(top)]

        groups.append(
            {
                "group": group,
                "threads": len(tids[group]),
                "cores": round(cores[group], 4),
                "samples": total,
                "idle_samples": idle[group],
                "stages": shares(stages[group]) if total else [],
                "functions": shares(own[group]) if total else [],
            }
        )
    return {
        "window_s": round(window_s, 3),
        "samples": sum(s.count for s in samples),
        "cores": round(sum(cores.values()), 4),
        "groups": groups,
    }


def record(pid: int, seconds: int, rate: int, raw_out: Path, py_spy: str) -> dict[str, Any]:
    """py-spy on ``pid`` for ``seconds`` with the threads' CPU read around it; the summary."""
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate)]
    command += ["--format", "raw", "--threads", "--full-filenames", "--nolineno", "--output", str(raw_out)]
    before, started = thread_cpu(pid), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    after, window = thread_cpu(pid), time.perf_counter() - started
    if done.returncode != 0 or not raw_out.exists():
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    summary = summarise_profile(parse_collapsed(raw_out.read_text()), before, after, window)
    return {"command": " ".join(command), "rate_hz": rate, **summary}


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
    images_per_s = statistics.mean(float(end["limit"]["images_per_s"]) for end in ends)
    limit_ms = statistics.mean(float(end["limit"]["cpu_ms_per_image"]) for end in ends)
    cpu = best.get("cpu", {})
    server_ms = cpu.get("server_ms_per_request")
    report: dict[str, Any] = {
        "config": config,
        "limit_images_per_s": round(images_per_s, 1),
        "limit_cpu_ms_per_image": round(limit_ms, 4),
        "limit_runs_images_per_s": [end["limit"]["images_per_s"] for end in ends],
        "limit_best_batch": limit["limit"]["best_batch"],
        "saturation": {
            "concurrency": best.get("concurrency"),
            "urgent_fraction": best.get("urgent_fraction", 0.0),
            "throughput_rps": best["throughput_rps"],
            "ratio": round(float(best["throughput_rps"]) / images_per_s, 4),
            "mean_batch_size": best["mean_batch_size"],
            "latency": best["latency"],
            "errors": best["errors"],
            "cpu": cpu,
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
    every = [
        float(end["limit"]["every_core_images_per_s"]) for end in ends if "every_core_images_per_s" in end["limit"]
    ]
    if every:
        # every core at once with no serving layer: the machine's own ceiling (see ``limit.measure_every_core``)
        report["every_core_images_per_s"] = round(statistics.mean(every), 1)
        report["every_core_runs_images_per_s"] = every
        report["saturation"]["every_core_ratio"] = round(float(best["throughput_rps"]) / statistics.mean(every), 4)
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
    lines = [
        f"## service / limit: {sat['ratio']:.2f}",
        "",
        f"- limit: {report['limit_images_per_s']:.1f} images/s ({report['limit_cpu_ms_per_image']:.3f} ms CPU "
        f"per image at batch {report['limit_best_batch']}; measured "
        f"{' and '.join(f'{v:.1f}' for v in report['limit_runs_images_per_s'])})",
        f"- service at saturation (concurrency {sat['concurrency']}, {sat.get('urgent_fraction', 0.0):.0%} urgent): "
        f"{sat['throughput_rps']:.1f} requests/s, "
        f"mean batch {sat['mean_batch_size']:.1f}",
    ]
    if "every_core_ratio" in sat:
        lines.append(
            f"- every core at once with no serving layer: {report['every_core_images_per_s']:.1f} images/s "
            f"({report['every_core_images_per_s'] / report['limit_images_per_s']:.2f} of the limit); "
            f"**service / every core: {sat['every_core_ratio']:.2f}**"
        )
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
            f"| {row['concurrency']} | {row['throughput_rps']:.1f} | {row['ratio']:.2f} | {row['mean_batch_size']:.1f} "
            f"| {row['p50_ms']:.0f} | {row['p99_ms']:.0f} | {'-' if server is None else f'{server:.3f}'} "
            f"| {'-' if other is None else f'{other:.2f}'} |"
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


Run = tuple[str, dict[str, Any], dict[str, Any] | None]
"""A variant's label, one round's bench report, and the limit measured in that round (if any)."""


def compare(limit: dict[str, Any], runs: Sequence[Run]) -> dict[str, Any]:
    """Variants measured in interleaved rounds: per variant, the median of its rounds.

    A run with its round's own limit is divided by that one: the machine's speed drifts
    between rounds, and a ratio taken within a minute is steadier than one across the run.
    """
    images_per_s = float(limit["limit"]["images_per_s"])
    limit_ms = float(limit["limit"]["cpu_ms_per_image"])
    by_label: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for label, bench, round_limit in runs:
        by_label[label].append((bench, (round_limit or limit)["limit"]))
    rows = []
    for label, pairs in by_label.items():
        benches = [bench for bench, _ in pairs]
        rps = statistics.median(float(b["throughput_rps"]) for b in benches)
        ratios = [float(b["throughput_rps"]) / float(lim["images_per_s"]) for b, lim in pairs]
        cpu_ratios = [
            float(lim["cpu_ms_per_image"]) / float(b["cpu"]["server_ms_per_request"])
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
                "mean_batch_size": round(statistics.median(b["mean_batch_size"] for b in benches), 2),
                "p50_ms": round(statistics.median(b["latency"]["all"]["p50_ms"] for b in benches), 1),
                "other_cores": [b.get("cpu", {}).get("other_cores") for b in benches],
            }
        )
    round_limits: list[dict[str, Any]] = []  # each round's limit once, in order
    for _, _, round_limit in runs:
        if round_limit is not None and not any(round_limit is seen for seen in round_limits):
            round_limits.append(round_limit)
    return {
        "limit_images_per_s": images_per_s,
        "limit_cpu_ms_per_image": limit_ms,
        "round_limits": [float(r["limit"]["images_per_s"]) for r in round_limits],
        "variants": rows,
    }


def compare_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"limit {result['limit_images_per_s']:.1f} images/s, {result['limit_cpu_ms_per_image']:.3f} ms CPU per image"
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
            f"| {row['mean_batch_size']:.1f} | {row['p50_ms']:.0f} "
            f"| {others} |"
        )
    return "\n".join(lines)


def _compare(args: argparse.Namespace) -> int:
    limit = json.loads(args.limit.read_text())
    runs: list[Run] = []
    limits: dict[str, dict[str, Any]] = {}  # one object per file: a round's limit is shared by its runs
    for item in args.run:
        label, _, paths = item.partition("=")
        bench_path, _, limit_path = paths.partition("@")
        if limit_path and limit_path not in limits:
            limits[limit_path] = json.loads(Path(limit_path).read_text())
        runs.append((label, json.loads(Path(bench_path).read_text()), limits.get(limit_path)))
    result = compare(limit, runs)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=2) + "\n")
    text = compare_markdown(result)
    if args.out_md:
        args.out_md.write_text(text + "\n")
    print(text)
    return 0


def _profile(args: argparse.Namespace) -> int:
    py_spy = args.py_spy or shutil.which("py-spy")
    if py_spy is None:
        print("ratio profile: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 1
    raw = args.raw or Path(tempfile.mkstemp(suffix=".txt", prefix="py-spy-")[1])
    summary = record(args.pid, args.seconds, args.rate, raw, py_spy)
    summary["raw"] = str(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _report(args: argparse.Namespace) -> int:
    limit = json.loads(args.limit.read_text())
    benches = [json.loads(path.read_text()) for path in args.bench]
    profile = json.loads(args.profile.read_text()) if args.profile else None
    if profile is not None and args.profile_bench:
        profile["throughput_rps"] = json.loads(args.profile_bench.read_text())["throughput_rps"]
    config = dict(item.split("=", 1) for item in args.config)
    after = json.loads(args.limit_after.read_text()) if args.limit_after else None
    core = json.loads(args.core.read_text()) if args.core else None
    floor = json.loads(args.floor.read_text()) if args.floor else None
    report = build_report(limit, benches, profile, config, after, core, floor)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    if args.out_md:
        args.out_md.write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench.ratio", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prof = commands.add_parser("profile", help="py-spy + per-thread CPU of a running server")
    prof.add_argument("--pid", type=int, required=True)
    prof.add_argument("--seconds", type=int, default=8, help="whole seconds (py-spy's unit)")
    prof.add_argument("--rate", type=int, default=100, help="samples per second")
    prof.add_argument("--py-spy", help="the py-spy executable (default: on PATH)")
    prof.add_argument("--raw", type=Path, help="keep py-spy's raw output here")
    prof.add_argument("--out", type=Path, required=True, help="the profile summary (JSON)")
    rep = commands.add_parser("report", help="join limit, bench and profile reports")
    rep.add_argument("--limit", type=Path, required=True, help="ai-backend limit's JSON report")
    rep.add_argument("--limit-after", type=Path, help="the limit measured again after the service")
    rep.add_argument("--bench", type=Path, nargs="+", required=True, help="ai-backend bench JSON reports")
    rep.add_argument("--profile", type=Path, help="a profile summary from `profile`")
    rep.add_argument("--core", type=Path, help="ai-backend core's JSON report: the service with no HTTP")
    rep.add_argument("--floor", type=Path, help="ai-backend bench's JSON report against ai-backend floor")
    rep.add_argument("--profile-bench", type=Path, help="the bench report of the profiled run")
    rep.add_argument("--config", nargs="*", default=[], help="KEY=VALUE pairs recorded with the report")
    rep.add_argument("--out-json", type=Path, required=True)
    rep.add_argument("--out-md", type=Path)
    cmp = commands.add_parser("compare", help="variants measured in interleaved rounds, side by side")
    cmp.add_argument("--limit", type=Path, required=True, help="ai-backend limit's JSON report")
    cmp.add_argument(
        "--run", nargs="+", required=True, help="LABEL=BENCH_JSON[@ROUND_LIMIT_JSON], one per variant and round"
    )
    cmp.add_argument("--out-json", type=Path, required=True)
    cmp.add_argument("--out-md", type=Path)
    args = parser.parse_args(argv)
    handlers = {"profile": _profile, "report": _report, "compare": _compare}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
