#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU. Usage: scripts/gpu_check.sh [OUT_DIR]  (default out/gpu)
#
#  (i)   the GPU tests (tests/gpu: fp16 on cuda:0 against fp32 on the CPU, the warmed model's memory in
#        /healthz and /metrics, a real out-of-memory split and the ceiling climbing back, memory given
#        back at shutdown, the served process on cuda:0 exiting 0 on SIGTERM);
#  (ii)  the batch-size sweep of MODEL (mobilenet_v3_small, exported with seed 0) on cuda:0 in fp16;
#  (iii) the decode cost on one CPU core (ai-backend limit, its forward pass left out) and the GPU limit:
#        the device decodes nothing, so images/s = min(cores / decode CPU s an image, the device's
#        images/s at its best batch in the sweep, the host-to-device copy included);
#  (iv)  the same service with no HTTP in front (ai-backend core), then served (ai-backend serve) and
#        driven closed-loop at each of CONCURRENCIES (ai-backend bench, base64 JSON bodies): its
#        throughput against that limit.
# Writes OUT_DIR/summary.md and every report beside it. PYTHON (default .venv/bin/python) runs each
# step; each is bounded in time. Knobs: MODEL, CONCURRENCIES ("64 256"), DURATION (8), PORT (8932), SWEEP_MAX (512),
# py-spy on the PATH adds a profile of the served process (py-spy-served.txt, raw folded stacks).
# DEVICE (cuda; cpu runs the same steps on the CPU, to try the script where there is no GPU), E2E (set: the
# end-to-end tests too, after the figures), CORE_VARIANTS (the in-process run again with other settings).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-.venv/bin/python}
model=${MODEL:-mobilenet_v3_small}
device=${DEVICE:-cuda}  # cpu: a dry run of the plumbing on a machine without a GPU
port=${PORT:-8932}
duration=${DURATION:-8}
repo="$out/repo"
log() { echo "== $(date +%T) $*" | tee -a "$out/steps.log"; }

log "device"
"$py" - >"$out/device.txt" 2>&1 <<'PY'
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cores", len(os.sched_getaffinity(0)))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}")
else:
    print("no CUDA device")
PY
cat "$out/device.txt"

log "(i) tests/gpu"
timeout 240 "$py" -m pytest tests/gpu -v -s -rA -p no:cacheprovider >"$out/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$out/steps.log"
tail -15 "$out/tests.log"

log "(ii) sweep"
timeout 60 "$py" -m app.cli export --arch "$model" --out "$repo" --seed 0 >"$out/export.log" 2>&1
timeout 120 "$py" -m app.cli sweep --repository "$repo" --model "$model" --device "$device" --dtype auto \
  --max-batch "${SWEEP_MAX:-512}" --seconds-per-size 1.5 --out-json "$out/sweep.json" --out-png "$out/sweep.png" \
  >"$out/sweep.md" 2>"$out/sweep.log"
echo "sweep rc=$?" | tee -a "$out/steps.log"
cat "$out/sweep.md"

log "(iii) decode cost"
timeout 120 "$py" -m app.cli limit --repository "$repo" --model "$model" --images-out "$out/images" --batch-sizes 1 \
  --seconds 1 --pipeline-seconds 0 --every-core-seconds 0 --out "$out/limit.json" >"$out/limit.md" 2>"$out/limit.log"
echo "limit rc=$?" | tee -a "$out/steps.log"

serve_batch=$("$py" -c "import json; print(json.load(open('$out/sweep.json'))['recommendation']['max_batch'] or 64)" 2>/dev/null || echo 64)
export AI_SERVICE_MODEL__REPOSITORY="$repo" AI_SERVICE_MODEL__NAMES="[\"$model\"]" AI_SERVICE_MODEL__DEFAULT="$model"
export AI_SERVICE_MODEL__DEVICE="$device" AI_SERVICE_BATCHING__NORMAL__MAX_BATCH="$serve_batch"
export AI_SERVICE_SERVER__MAX_IMAGE_BYTES=4194304 AI_SERVICE_LOGGING__ACCESS_LOG=false

log "(iv) core, no HTTP (normal max batch $serve_batch)"
timeout 90 "$py" -m app.cli core --images "$out/images" --concurrency 256 --seconds "$duration" --warmup 3 \
  --out "$out/core.json" >/dev/null 2>"$out/core.log"
echo "core rc=$?" | tee -a "$out/steps.log"
# CORE_VARIANTS="label:ENV=V ENV2=V2;label2:ENV=V": the same in-process run with other settings, after the
# defaults', into core-LABEL.json (the next GPU levers: decode threads, say)
IFS=';' read -ra variants <<<"${CORE_VARIANTS:-}"
for variant in "${variants[@]}"; do
  label=${variant%%:*}
  read -ra assignments <<<"${variant#*:}"
  timeout 90 env "${assignments[@]}" "$py" -m app.cli core --images "$out/images" --concurrency 256 --seconds "$duration" \
    --warmup 3 --out "$out/core-$label.json" >/dev/null 2>"$out/core-$label.log"
  echo "core $label rc=$?" | tee -a "$out/steps.log"
done

log "(iv) served"
"$py" -m app.cli serve --port "$port" >"$out/server.log" 2>&1 &
server=$!
get() {  # get PATH FILE: the body, once /readyz answers 200 (at most 120 s) or the server is gone
  "$py" - "http://127.0.0.1:$port" "$1" "$2" "$server" <<'PY'
import os, sys, time, httpx
url, path, file, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        if httpx.get(url + "/readyz").status_code == 200:
            break
    except httpx.TransportError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        break
    time.sleep(0.2)
open(file, "w").write(httpx.get(url + path, timeout=10).text)
PY
}
get /healthz "$out/healthz.json"
for c in ${CONCURRENCIES:-64 256}; do
  timeout $((duration + 60)) "$py" -m app.cli bench --url "http://127.0.0.1:$port" --client raw --images "$out/images" \
    --concurrency "$c" --duration "$duration" --warmup 3 --server-pid "$server" --out "$out/bench-c$c.json" >/dev/null 2>"$out/bench-c$c.log"
  echo "bench c=$c rc=$?" | tee -a "$out/steps.log"
done
if command -v py-spy >/dev/null; then  # where the served process's time goes, at the last concurrency
  last=${c:-256}
  timeout 60 "$py" -m app.cli bench --url "http://127.0.0.1:$port" --client raw --images "$out/images" \
    --concurrency "$last" --duration 9 --warmup 2 --out "$out/bench-profiled.json" >/dev/null 2>&1 &
  profiled=$!
  sleep 3
  timeout 30 py-spy record --pid "$server" --duration 5 --rate 200 --format raw --native \
    --output "$out/py-spy-served.txt" >"$out/py-spy.log" 2>&1
  echo "py-spy rc=$?" | tee -a "$out/steps.log"
  wait "$profiled"
fi
get /metrics "$out/metrics.txt"
kill -TERM "$server"
wait "$server"
echo "server exit $?" | tee -a "$out/steps.log"

if [ -n "${E2E:-}" ]; then  # the end-to-end suite on this machine's defaults (cuda:0, fp16)
  log "(v) tests/e2e"
  timeout 200 "$py" -m pytest tests/e2e -q -rA -p no:cacheprovider >"$out/e2e.log" 2>&1
  echo "e2e rc=$?" | tee -a "$out/steps.log"
  tail -30 "$out/e2e.log"
fi

log "summary"
"$py" - "$out" >"$out/summary.md" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def read(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
lines = ["# GPU check", "", open(os.path.join(out, "device.txt")).read().strip(), ""]
sweep, limit, core = read("sweep.json"), read("limit.json"), read("core.json")
device_best = None
if sweep:
    ok = [s for s in sweep["sizes"] if s["status"] == "ok"]
    best = max(ok, key=lambda s: s["throughput"])
    device_best = best["throughput"]
    lines.append(f"- sweep on {sweep['device']} ({sweep['dtype']}): best {best['throughput']:.0f} images/s at batch "
                 f"{best['batch_size']} ({best['median_ms']:.2f} ms); recommended max batch {sweep['recommendation']['max_batch']}")
    for s in sweep["sizes"]:
        memory = s.get("memory") or {}
        lines.append(f"  - batch {s['batch_size']}: {s['status']}, {s.get('throughput') or 0:.0f} images/s, "
                     f"median {s.get('median_ms') or 0:.2f} ms, memory {json.dumps(memory)[:160]}")
if limit:
    decode_ms, cores = limit["limit"]["decode_cpu_ms"], limit["limit"]["cores"]
    decode_rate = cores / (decode_ms / 1000)
    lines.append(f"- decode: {decode_ms:.3f} ms CPU an image on one core; {cores:g} cores: {decode_rate:.0f} images/s")
    if device_best:
        gpu_limit = min(decode_rate, device_best)
        lines.append(f"- **GPU limit** min(decode {decode_rate:.0f}, device {device_best:.0f}) = **{gpu_limit:.0f} images/s**")
        if core:
            lines.append(f"- core, no HTTP: {core.get('throughput_rps')} requests/s = {core.get('throughput_rps', 0) / gpu_limit:.2f} of it")
        for path in sorted(glob.glob(os.path.join(out, "core-*.json"))):
            variant = json.load(open(path))
            lines.append(f"- core, no HTTP, {os.path.basename(path)[5:-5]}: {variant['throughput_rps']} requests/s = "
                         f"{variant['throughput_rps'] / gpu_limit:.2f} of it, cpu {json.dumps(variant.get('cpu'))[:300]}")
        for path in sorted(glob.glob(os.path.join(out, "bench-c*.json"))):
            b = json.load(open(path))
            latency = {lane: (v["p50_ms"], v["p99_ms"]) for lane, v in b["latency"].items() if v["count"]}
            lines.append(f"- served, {os.path.basename(path)}: {b['throughput_rps']} requests/s = "
                         f"**{b['throughput_rps'] / gpu_limit:.2f}** of the limit, mean batch {b.get('mean_batch_size')}, "
                         f"errors {b.get('errors')}, p50/p99 ms {latency}, server stages {json.dumps(b.get('server_stages_ms'))[:400]}, "
                         f"cpu {json.dumps(b.get('cpu'))[:300]}, threads {json.dumps(b.get('server_threads'))[:600]}")
print("\n".join(lines))
PY
cat "$out/summary.md"
