#!/usr/bin/env bash
# Latency under load, in one run. Usage: scripts/bench_load.sh [OUT_DIR]   (default out/load)
#
#  (i)   exports MODEL (mobilenet_v3_small, seed 0) into a temporary repository, unless REPOSITORY
#        holds it, and makes the 640x480 JPEGs with `ai-backend limit` (which also gives the time
#        one max batch takes, for the urgent lane's bound);
#  (ii)  serves it on the defaults, with the limit's serving batch as the normal lane's max batch;
#  (iii) saturation: closed loop at SATURATION_CONCURRENCY (64) for DURATION (10) seconds;
#  (iv)  open loop (Poisson arrivals) at 70% of that rate, 10% urgent, for STEADY_SECONDS (30);
#  (v)   saturation again, closed loop as in (iii), then open loop at twice that rate, 10% urgent,
#        every request with a deadline of DEADLINE_MS (1000), for OVERLOAD_SECONDS (60);
#  (vi)  saturation again: the answered share in (v) is taken against the mean of the saturation
#        just before and just after it, since the host's speed drifts while the run goes on;
#  (vii) the minute of (v) again, at the same rate, on a fresh server (its first load; FRESH_SECONDS,
#        60; 0 skips it): what a process started into heavy traffic answers, expires and grows;
#  (viii) writes OUT_DIR/load.md (and the bench reports beside it), with the server's own samples
#        of its event loop's lag in each measured window (`bench --server-metrics`): a stall of the
#        loop shows there, starved decode or device threads do not.
#
# Only loopback traffic, bounded in count and time. Knobs (environment): PORT (8932), MODEL,
# REPOSITORY, IMAGES (a folder of images: skips making them), and any AI_SERVICE_* setting.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-out/load}
mkdir -p "$out"
py=${PYTHON:-"$root/.venv/bin/python"}
port=${PORT:-8932}
BENCH_NAME=load
# shellcheck source=scripts/bench_common.sh
source "$root/scripts/bench_common.sh"

# (i)
export_model
images=${IMAGES:-$out/images}
if [ -n "${IMAGES:-}" ]; then image_args=(--images "$images"); else image_args=(--images-out "$images"); fi
logged "$out/limit.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" "${image_args[@]}" \
  --pipeline-seconds 0 --every-core-seconds 0 --seconds 1 --out "$out/limit.json" >/dev/null
serve_batch=$(field "$out/limit.json" "r['limit'].get('serve_batch', r['limit']['best_batch'])")

# (ii)
export AI_SERVICE_MODEL__REPOSITORY="$repo" AI_SERVICE_MODEL__NAMES="[\"$model\"]" AI_SERVICE_MODEL__DEFAULT="$model"
export AI_SERVICE_BATCHING__NORMAL__MAX_BATCH="${AI_SERVICE_BATCHING__NORMAL__MAX_BATCH:-$serve_batch}"
refuse_taken_port
"$py" -m app.cli serve --port "$port" >"$out/server.log" 2>&1 &
server_pid=$!
wait_ready "$out/server.log"
bench() {  # bench OUT_JSON ARGS...
  local report=$1
  shift
  "$py" -m app.cli bench --url "http://127.0.0.1:$port" --client raw --images "$images" --server-pid "$server_pid" \
    --server-metrics --urgent-fraction 0.1 --out "$report" "$@" >/dev/null
}

# (iii) - (v)
bench "$out/saturation.json" --concurrency "${SATURATION_CONCURRENCY:-64}" --duration "${DURATION:-10}" --warmup 3
saturation=$(field "$out/saturation.json" "r['throughput_rps']")
echo "saturation: $saturation requests/s"
steady=$("$py" -c "print(round(0.7 * $saturation, 1))")
bench "$out/steady.json" --rate "$steady" --duration "${STEADY_SECONDS:-30}" --warmup 3
echo "70%: $(field "$out/steady.json" "r['throughput_rps']") requests/s"
# saturation again, just before the minute at twice the load: the host's speed drifts by a
# tenth or more within minutes, and the 70% run took half a minute
bench "$out/saturation_before.json" --concurrency "${SATURATION_CONCURRENCY:-64}" --duration "${DURATION:-10}" --warmup 3
before=$(field "$out/saturation_before.json" "r['throughput_rps']")
echo "saturation before twice the load: $before requests/s"
overload=$("$py" -c "print(round(2 * $before, 1))")
bench "$out/overload.json" --rate "$overload" --duration "${OVERLOAD_SECONDS:-60}" --warmup 3 \
  --deadline-ms "${DEADLINE_MS:-1000}" --timeout 30
echo "200%: $(field "$out/overload.json" "r['throughput_rps']") requests/s answered"
# and just after it: the answered share at twice the load is taken against the mean of the two
bench "$out/saturation_after.json" --concurrency "${SATURATION_CONCURRENCY:-64}" --duration "${DURATION:-10}" --warmup 3
echo "saturation after: $(field "$out/saturation_after.json" "r['throughput_rps']") requests/s"
# (vii) the minute at twice the load again, on a fresh server: in (v) the server has run every load
# before it, while a process started into traffic (a deploy under load) meets it cold, before its
# allocator and oneDNN have set up what the batches it forms need. FRESH_SECONDS=0 skips it
rm -f "$out/overload_fresh.json"
if [ "${FRESH_SECONDS:-60}" != 0 ]; then
  stop_server
  "$py" -m app.cli serve --port "$port" >"$out/server-fresh.log" 2>&1 &
  server_pid=$!
  wait_ready "$out/server-fresh.log"
  bench "$out/overload_fresh.json" --rate "$overload" --duration "${FRESH_SECONDS:-60}" --warmup 3 \
    --deadline-ms "${DEADLINE_MS:-1000}" --timeout 30
  echo "200%, fresh server: $(field "$out/overload_fresh.json" "r['throughput_rps']") requests/s answered"
fi

# (viii)
"$py" - "$out" <<'PY'
import json
import os
import sys
from pathlib import Path

from app.bench.loadgen.scrape import lag_line
from app.bench.loadgen.summary import expired, schedule_line
from app.settings import BatchingSettings

out = Path(sys.argv[1])
limit = json.loads((out / "limit.json").read_text())
sat, steady, before, over, after = (
    json.loads((out / f"{name}.json").read_text())
    for name in ("saturation", "steady", "saturation_before", "overload", "saturation_after")
)
reference = (before["throughput_rps"] + after["throughput_rps"]) / 2
# the largest batch the server runs (either lane's max batch), timed in process at that size
# (or the nearest size measured above it, else the largest measured)
urgent_max = os.environ.get("AI_SERVICE_BATCHING__URGENT__MAX_BATCH") or BatchingSettings().urgent.max_batch
best = max(int(os.environ["AI_SERVICE_BATCHING__NORMAL__MAX_BATCH"]), int(urgent_max))
rows = sorted(limit["limit"]["forward_1_thread"], key=lambda f: f["batch_size"])
forward = next((f for f in rows if f["batch_size"] >= best), rows[-1])
batch_ms = forward["wall_ms_per_image"] * best
bound = 2 + batch_ms


def lanes(report: dict) -> str:
    rows = []
    for lane in ("urgent", "normal", "refused"):
        latency = report["latency"][lane]
        if latency["count"]:
            rows.append(
                f"| {lane} | {latency['count']} | {latency['p50_ms']:.1f} | {latency['p90_ms']:.1f} "
                f"| {latency['p99_ms']:.1f} | {latency['max_ms']:.1f} |"
            )
    return "\n".join(["| lane | answered | p50 ms | p90 ms | p99 ms | max ms |", "| --- | ---: | ---: | ---: | ---: | ---: |", *rows])


def errors_of(report: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(report["errors"].items())) or "none"


def memory_line(report: dict) -> str:
    rss, pss = report.get("server_rss_mb", {}), report.get("server_pss_mb")
    processes = report.get("server_memory", {}).get("processes", 1)
    return (
        f"- server memory (RSS{f' of its {processes} processes' if processes > 1 else ''}, once a second): "
        f"first {rss.get('first')} MiB, last {rss.get('last')} MiB, "
        f"max {rss.get('max')} MiB; over the second half of the minute {rss.get('second_half_growth', 0):+} MiB"
        + (f" (PSS, shared pages counted once: max {pss['max']} MiB, {pss['second_half_growth']:+} MiB)" if pss else "")
    )


urgent, normal = steady["latency"]["urgent"], steady["latency"]["normal"]
answered = over["throughput_rps"]

lines = [
    f"## latency under load: {limit['model']} v{limit['version']}, {limit['limit']['cores']:g} cores",
    "",
    f"- saturation (closed loop, {sat['concurrency']} clients): **{sat['throughput_rps']} requests/s**, "
    f"mean batch {sat['mean_batch_size']}",
    lag_line(sat.get("server_loop_lag")),
    f"- one max batch ({best}) takes {batch_ms:.1f} ms in process (one torch thread); the urgent bound is "
    f"2 ms + that = {bound:.1f} ms plus overhead",
    "",
    f"### 70% of saturation: {steady['rate_rps']} requests/s offered (Poisson), 10% urgent",
    "",
    f"answered {steady['throughput_rps']} requests/s, mean batch {steady['mean_batch_size']} "
    f"(by request lane: urgent {steady['mean_batch_size_by_request_lane']['urgent']}, "
    f"normal {steady['mean_batch_size_by_request_lane']['normal']}), "
    f"errors: {errors_of(steady)}",
    "",
    lanes(steady),
    "",
    "where the time went, by the server's own timings (p50 / p99 ms):",
    "",
    "| lane | preprocess | queue | inference | total in the app |",
    "| --- | ---: | ---: | ---: | ---: |",
    *(
        f"| {lane} | "
        + " | ".join(
            f"{stages[name]['p50']:.1f} / {stages[name]['p99']:.1f}"
            for name in ("preprocess", "queue", "inference", "total")
        )
        + " |"
        for lane, stages in steady.get("server_stages_ms", {}).items()
        if stages
    ),
    "",
    f"- urgent p99 {urgent['p99_ms']:.1f} ms {'<' if urgent['p99_ms'] < normal['p50_ms'] else '>='} "
    f"normal p50 {normal['p50_ms']:.1f} ms",
    f"- urgent p99 {urgent['p99_ms']:.1f} ms against the bound {bound:.1f} ms: overhead "
    f"{urgent['p99_ms'] - bound:+.1f} ms",
    lag_line(steady.get("server_loop_lag")),
    schedule_line(steady),
    "",
    f"### twice saturation: {over['rate_rps']} requests/s offered for {over['measured_s']:.0f} s, "
    f"deadline {over['deadline_ms']:.0f} ms, 10% urgent",
    "",
    f"- answered: {answered} requests/s = **{answered / reference:.3f} of saturation** (the mean of "
    f"{before['throughput_rps']} just before and {after['throughput_rps']} just after; "
    f"{answered / sat['throughput_rps']:.3f} of the first, {sat['throughput_rps']}), mean batch {over['mean_batch_size']}",
    f"- answered later than their deadline (client clock): **{over['ok_past_deadline']}** of {over['ok']}; "
    f"by the server's own clock (its total from the request's first byte): "
    f"**{over.get('ok_past_deadline_server', 'not reported')}**",
    f"- refused: {errors_of(over)}",
    memory_line(over),
    lag_line(over.get("server_loop_lag")),
    schedule_line(over),
    "",
    lanes(over),
]
fresh_path = out / "overload_fresh.json"
if fresh_path.exists():  # (vii): the same load, on a server that had served nothing
    fresh = json.loads(fresh_path.read_text())
    lines += [
        "",
        f"### twice saturation on a fresh server: {fresh['rate_rps']} requests/s offered for "
        f"{fresh['measured_s']:.0f} s after a {fresh['warmup_s']:.0f} s warm-up, as above",
        "",
        f"- answered: {fresh['throughput_rps']} requests/s = "
        f"**{fresh['throughput_rps'] / reference:.3f} of saturation** (the same mean), "
        f"mean batch {fresh['mean_batch_size']}",
        f"- answered later than their deadline (client clock): **{fresh['ok_past_deadline']}** of {fresh['ok']}; "
        f"admitted, then expired before being computed (503 deadline_exceeded): **{expired(fresh)}**",
        f"- refused: {errors_of(fresh)}",
        memory_line(fresh),
        lag_line(fresh.get("server_loop_lag")),
        "",
        lanes(fresh),
    ]
text = "\n".join(lines) + "\n"
(out / "load.md").write_text(text)
print(text)
PY
