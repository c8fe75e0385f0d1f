#!/usr/bin/env bash
# What a missing or broken trace collector costs the requests, in one run.
#
# Serves the bundled model once per exporter setting and drives it with the closed-loop load
# generator (`ai-backend bench`), all on loopback:
#   none            no exporter: the baseline
#   grpc-dead       otlp_grpc to a port where nothing listens
#   http-dead       otlp_http to the same dead port
#   grpc-blackhole  otlp_grpc to a listener that accepts connections and never answers
#   http-blackhole  otlp_http to the same black hole
# The five cases run in turn, ROUNDS times over (interleaved, so that drift in the machine's
# load hits every case alike); it prints, per case, the median over the rounds of throughput
# and p50/p99 latency, their ratios to `none`, the range of throughput over the rounds (the
# noise), ai_backend_dropped_spans_total at the end of each run, the longest exit after
# SIGTERM (the span flush is bounded) and failed requests. JSON reports and logs go to $OUT.
#
# Usage: scripts/bench_exporters.sh
#   env: ROUNDS=3 CONCURRENCY=8 DURATION=10 WARMUP=2 OUT=out/bench_exporters
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-8}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
OUT=${OUT:-out/bench_exporters}
START_TIMEOUT_S=120
STOP_TIMEOUT_S=60
HOLE_LIFETIME_S=1800 # the black hole ends itself even if this script is killed hard

python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv>=0.5"
python3 -m uv sync --frozen --quiet
PY=$(python3 -m uv run --frozen python -c 'import sys; print(sys.executable)')
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.log "$OUT"/*.txt

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

server_pid=""
hole_pid=""
cleanup() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then kill -KILL "$server_pid" 2>/dev/null || true; fi
    if [[ -n "$hole_pid" ]] && kill -0 "$hole_pid" 2>/dev/null; then kill "$hole_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

# A black hole: accepts every connection, never reads, never answers (at most 256 held).
HOLE_PORT=$(free_port)
"$PY" - "$HOLE_PORT" "$HOLE_LIFETIME_S" <<'EOF' &
import socket, sys, time
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
server.settimeout(1.0)
held = []
ends = time.monotonic() + float(sys.argv[2])
while time.monotonic() < ends:
    try:
        connection, _ = server.accept()
    except TimeoutError:
        continue
    held.append(connection)
    for old in held[:-256]:
        old.close()
    del held[:-256]
EOF
hole_pid=$!
DEAD_PORT=$(free_port) # nothing listens here

wait_ready() { # $1 port: poll /readyz until 200 (bounded)
    "$PY" - "$1" "$START_TIMEOUT_S" <<'EOF'
import sys, time, urllib.request
url, ends = f"http://127.0.0.1:{sys.argv[1]}/readyz", time.monotonic() + float(sys.argv[2])
while time.monotonic() < ends:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit(f"not ready within {sys.argv[2]} s")
EOF
}

dropped_spans() { # $1 port: the value of ai_backend_dropped_spans_total
    "$PY" - "$1" <<'EOF'
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10) as response:
    text = response.read().decode()
for family in text_string_to_metric_families(text):
    for sample in family.samples:
        if sample.name == "ai_backend_dropped_spans_total":
            print(int(sample.value))
EOF
}

run_case() { # $1 name, $2 exporter, $3 endpoint (or "")
    local name=$1 exporter=$2 endpoint=$3 port started stopped
    port=$(free_port)
    echo "== $name: exporter=$exporter endpoint=${endpoint:-none}" >&2
    env AI_SERVICE_TELEMETRY__EXPORTER="$exporter" ${endpoint:+AI_SERVICE_TELEMETRY__ENDPOINT="$endpoint"} \
        "$PY" -m app.cli serve --host 127.0.0.1 --port "$port" >"$OUT/$name.server.log" 2>&1 &
    server_pid=$!
    wait_ready "$port"
    "$PY" -m app.cli bench --url "http://127.0.0.1:$port" --concurrency "$CONCURRENCY" \
        --duration "$DURATION" --warmup "$WARMUP" --server-pid "$server_pid" --out "$OUT/$name.json" >/dev/null
    dropped_spans "$port" >"$OUT/$name.dropped.txt"
    started=$(date +%s.%N)
    kill -TERM "$server_pid"
    for _ in $(seq $((STOP_TIMEOUT_S * 10))); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$server_pid" 2>/dev/null; then
        echo "$name: no exit ${STOP_TIMEOUT_S}s after SIGTERM; killed" >&2
        kill -KILL "$server_pid"
    fi
    wait "$server_pid" 2>/dev/null || true
    stopped=$(date +%s.%N)
    echo "$started $stopped" | awk '{printf "%.1f\n", $2 - $1}' >"$OUT/$name.stop_s.txt"
    server_pid=""
}

for round in $(seq "$ROUNDS"); do
    run_case "none.$round" none ""
    run_case "grpc-dead.$round" otlp_grpc "http://127.0.0.1:$DEAD_PORT"
    run_case "http-dead.$round" otlp_http "http://127.0.0.1:$DEAD_PORT"
    run_case "grpc-blackhole.$round" otlp_grpc "http://127.0.0.1:$HOLE_PORT"
    run_case "http-blackhole.$round" otlp_http "http://127.0.0.1:$HOLE_PORT"
done

"$PY" - "$OUT" "$ROUNDS" "$CONCURRENCY" "$DURATION" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, rounds, concurrency, duration = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
cases = ["none", "grpc-dead", "http-dead", "grpc-blackhole", "http-blackhole"]
summary = {}
for case in cases:
    runs = []
    for n in range(1, rounds + 1):
        report = json.loads((out / f"{case}.{n}.json").read_text())
        latency = report["latency"]["all"]
        runs.append({
            "rps": report["throughput_rps"], "p50": latency["p50_ms"], "p99": latency["p99_ms"],
            "dropped": int((out / f"{case}.{n}.dropped.txt").read_text().strip() or 0),
            "stop_s": float((out / f"{case}.{n}.stop_s.txt").read_text()),
            "errors": sum(report["errors"].values()),
            "server_ms": report.get("cpu", {}).get("server_ms_per_request", float("nan")),
            "other_cores": report.get("cpu", {}).get("other_cores", float("nan")),
        })
    rps = [r["rps"] for r in runs]
    summary[case] = {
        "rps": statistics.median(rps), "rps_range": [min(rps), max(rps)],
        "p50": statistics.median(r["p50"] for r in runs), "p99": statistics.median(r["p99"] for r in runs),
        "dropped": [r["dropped"] for r in runs], "stop_s": max(r["stop_s"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "server_cpu_ms_per_request": statistics.median(r["server_ms"] for r in runs),
        "other_cores": statistics.median(r["other_cores"] for r in runs),
    }
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
base = summary["none"]
load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
print(f"closed loop, {concurrency} clients, {duration} s measured per run, {rounds} rounds; medians, ratios to `none`;")
print(f"load average at the end (1, 5, 15 min): {load}\n")
print("| exporter | requests/s | p50 ms | p99 ms | throughput ratio | p50 ratio | p99 ratio "
      "| requests/s range | server CPU ms/request | other processes, cores | dropped spans per run "
      "| longest exit after SIGTERM s | failed requests |")
print("| --- |" + " ---: |" * 12)
for case, s in summary.items():
    low, high = s["rps_range"]
    print(f"| {case} | {s['rps']:.0f} | {s['p50']:.1f} | {s['p99']:.1f} | {s['rps'] / base['rps']:.2f} "
          f"| {s['p50'] / base['p50']:.2f} | {s['p99'] / base['p99']:.2f} | {low:.0f}-{high:.0f} "
          f"| {s['server_cpu_ms_per_request']:.1f} | {s['other_cores']:.2f} "
          f"| {', '.join(map(str, s['dropped']))} | {s['stop_s']:.1f} | {s['errors']} |")
EOF
