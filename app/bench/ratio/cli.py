"""The service's throughput at saturation as a share of the in-process limit, and where the rest goes.

``python -m app.bench.ratio profile --pid PID``: records a running server with py-spy and
reads every thread's CPU time from ``/proc`` over the same window. The CPU per thread
group (event loop, decode pool, device thread, native threads such as OpenMP's) is exact;
py-spy's samples split each group's CPU between functions ("own" time: the leaf frame)
and between stages (the deepest frame that names one, see ``profile.STAGES``).

``python -m app.bench.ratio report``: joins ``ai-backend limit``'s report, the closed-loop
bench reports (the best throughput is the saturation point) and the profile into one JSON
and a markdown summary. ``scripts/bench_ratio.sh`` runs the whole thing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.ratio.compare import Run, compare, compare_markdown
from app.bench.ratio.profile import record
from app.bench.ratio.report import build_report, markdown


def _write(result: dict[str, Any], render: Callable[[dict[str, Any]], str], args: argparse.Namespace) -> int:
    """Write ``result`` to ``--out-json``, then its markdown to ``--out-md`` (if given), and print the markdown."""
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    if args.out_md:
        args.out_md.write_text(text + "\n")
    print(text)
    return 0


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
    return _write(compare(limit, runs), compare_markdown, args)


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
    return _write(build_report(limit, benches, profile, config, after, core, floor), markdown, args)


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
