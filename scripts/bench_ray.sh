#!/usr/bin/env bash
# Ray Serve with 1 and with 2 replicas, in one run, against the bundled digits model.
# Usage: scripts/bench_ray.sh [OUT_DIR]   (default out/ray)
#
# Starts a local Ray cluster (ray.init, num_cpus=CPUS, no dashboard), Serve's proxy on a loopback
# port, and for each count in REPLICAS deploys app.ray_app:build with that many replicas (each asks
# Ray for 1 CPU: bookkeeping, not pinning), waits until ready, and drives it with
# `ai-backend bench --client raw` (closed loop, CONCURRENCY clients, URGENT_FRACTION urgent). With
# BASELINE=1 it first measures plain `ai-backend serve` with the same settings, for what Serve costs.
# Writes OUT_DIR/ray.md (a table: throughput, p99 per lane, mean batch size) and every bench report.
#
# Knobs (environment): CONCURRENCY (32), DURATION (10), WARMUP (3), URGENT_FRACTION (0.1),
# REPLICAS ("1 2"), CPUS (2), BASELINE (1), and any AI_SERVICE_* setting (passed to the replicas'
# environment as to the plain server's). Defaults for the server: one torch intra-op thread (two
# replicas would otherwise run four OpenMP threads on two cores), no access log.
# Bounded: each measurement is WARMUP + DURATION seconds; only 127.0.0.1 is spoken to.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/ray}
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || python3 -m uv sync --frozen --quiet
export AI_SERVICE_MODEL__INTRA_OP_THREADS=${AI_SERVICE_MODEL__INTRA_OP_THREADS:-1}
export AI_SERVICE_LOGGING__ACCESS_LOG=${AI_SERVICE_LOGGING__ACCESS_LOG:-false}
export AI_SERVICE_LOGGING__LEVEL=${AI_SERVICE_LOGGING__LEVEL:-WARNING}
export AI_SERVICE_MODEL__DEVICE=${AI_SERVICE_MODEL__DEVICE:-cpu}
export CONCURRENCY=${CONCURRENCY:-32} DURATION=${DURATION:-10} WARMUP=${WARMUP:-3}
export URGENT_FRACTION=${URGENT_FRACTION:-0.1} REPLICAS=${REPLICAS:-"1 2"} CPUS=${CPUS:-2} BASELINE=${BASELINE:-1}

exec "$py" - "$out" <<'PY'
import json, os, signal, socket, subprocess, sys, time, urllib.request
from pathlib import Path

out = Path(sys.argv[1]).resolve()
env = os.environ
bench_args = ["--client", "raw", "--concurrency", env["CONCURRENCY"], "--duration", env["DURATION"],
              "--warmup", env["WARMUP"], "--urgent-fraction", env["URGENT_FRACTION"]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {limit_s:.0f} s")


def bench(url: str, label: str) -> dict:
    report = out / f"{label}.json"
    subprocess.run([sys.executable, "-m", "app.cli", "bench", "--url", url, *bench_args, "--out", str(report)],
                   check=True, stdout=subprocess.DEVNULL, timeout=float(env["WARMUP"]) + float(env["DURATION"]) + 120)
    result = json.loads(report.read_text())
    print(f"{label}: {result['throughput_rps']} requests/s, mean batch {result['mean_batch_size']}", file=sys.stderr)
    return result


results: dict[str, dict] = {}
if env["BASELINE"] == "1":
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        results["ai-backend serve (1 process)"] = bench(f"http://127.0.0.1:{port}", "baseline")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

import ray
from ray import serve

from app.ray_app import build

ray.init(address="local", num_cpus=float(env["CPUS"]), include_dashboard=False, log_to_driver=False)
try:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for count in env["REPLICAS"].split():
        serve.run(build({"num_replicas": count, "num_cpus": "1", "model.repository": str(Path("models").resolve())}),
                  name="bench", route_prefix="/")
        wait_ready(f"http://127.0.0.1:{port}")
        results[f"Ray Serve, {count} replica{'s' if count != '1' else ''}"] = bench(
            f"http://127.0.0.1:{port}", f"serve-{count}")
        serve.delete("bench")
finally:
    serve.shutdown()
    ray.shutdown()

lines = [
    f"{env['CONCURRENCY']} closed-loop clients, {float(env['URGENT_FRACTION']):.0%} urgent, "
    f"{env['DURATION']} s measured after {env['WARMUP']} s, `ai-backend bench --client raw`, digits model, "
    f"{os.cpu_count()} CPUs",
    "",
    "| setup | requests/s | p99 urgent ms | p99 normal ms | p50 normal ms | mean batch size | errors |",
    "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
]
for label, r in results.items():
    lat = r["latency"]
    errors = ", ".join(f"{k} x{v}" for k, v in r["errors"].items()) or "none"
    batch = "-" if r["mean_batch_size"] is None else f"{r['mean_batch_size']:.1f}"
    lines.append(f"| {label} | {r['throughput_rps']:.0f} | {lat['urgent']['p99_ms']:.0f} | {lat['normal']['p99_ms']:.0f} "
                 f"| {lat['normal']['p50_ms']:.0f} | {batch} | {errors} |")
text = "\n".join(lines) + "\n"
(out / "ray.md").write_text(text)
(out / "ray.json").write_text(json.dumps(results, indent=2) + "\n")
print(text)
PY
