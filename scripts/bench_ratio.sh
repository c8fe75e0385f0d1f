#!/usr/bin/env bash
# The limit and the ratio, in one run. Usage: scripts/bench_ratio.sh [OUT_DIR]   (default out/ratio)
#
#  (i)   exports MODEL (mobilenet_v3_small, seed 0) into a temporary repository, unless REPOSITORY holds it;
#  (ii)  measures the in-process limit on 640x480 JPEGs (ai-backend limit);
#  (iii) serves that repository (ai-backend serve) with the settings below;
#  (iv)  finds saturation with closed-loop concurrency (ai-backend bench --client raw, JSON base64 bodies):
#        throughput / limit, mean batch size, per-lane latency, the CPU of server, client and others, and
#        the server's own samples of its event loop's lag (bench --server-metrics);
#  (v)   profiles the server at the saturation point (py-spy + per-thread CPU from /proc);
#  (vi)  drives the same service in process with no HTTP in front (ai-backend core) at that concurrency,
#  (vii) and serves it behind the least HTTP possible (ai-backend floor: httptools, json.loads, no ids,
#        metrics or logs), so the report tells what HTTP itself costs, what the serving layers on top
#        of it cost, and what the machine and the service's core cost.
# Writes OUT_DIR/ratio.json and OUT_DIR/ratio.md (and every intermediate report).
#
# Side by side: VARIANTS="label:ENV=V ENV2=V2;label2:ENV=V" runs each variant's server in turn, ROUNDS
# times interleaved (A B A B), at the saturation concurrency, into OUT_DIR/compare.md. A variant may
# set SERVER_TREE=/path to serve another checkout (e.g. a git worktree of the base commit).
#
# Knobs (environment): PORT (8931), CONCURRENCIES ("8 16 32 64 128"), DURATION (10), WARMUP (3),
# URGENT_FRACTION (0: requests on the urgent lane; the limit is a throughput figure, and urgent
# requests trade batch size for latency, so the headline ratio is plain traffic; 0.1 gives the
# mix the latency benchmark uses), MODEL (mobilenet_v3_small; any torchvision
# classifier), PROFILE_SECONDS (8), LIMIT_SECONDS (2), ROUNDS (2), VARIANT_CONCURRENCY (default: the
# saturation point), VARIANTS_ONLY (skip iii-v), REPOSITORY, LIMIT_JSON (reuse a limit report),
# QUIET_WAIT / QUIET_CORES (wait for an idle machine before each measurement), and any AI_SERVICE_* setting.
# The server runs on its defaults (on 2 cores: two device workers of one torch thread each, two
# decode workers, GIL switch interval 0.2 ms), with the limit's serving batch (the largest within 5% of the
# best batch's CPU per image) as the normal lane's max batch.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:-out/ratio}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: a variant's server runs in its own tree
py="$root/.venv/bin/python"
[ -x "$py" ] || { python3 -m uv sync --frozen --quiet; }
port=${PORT:-8931}
concurrencies=${CONCURRENCIES:-"8 16 32 64 128"}
duration=${DURATION:-10}
warmup=${WARMUP:-3}
profile_seconds=${PROFILE_SECONDS:-8}
BENCH_NAME=ratio
# shellcheck source=scripts/bench_common.sh
source "$root/scripts/bench_common.sh"
# wait_quiet: up to QUIET_WAIT seconds (default 120) for the rest of the machine to go idle
# (under QUIET_CORES busy cores, default 0.15, over 2 s): these machines are shared, and a
# measurement taken while something else runs is a measurement of both.
wait_quiet() {
  "$py" - "${QUIET_WAIT:-120}" "${QUIET_CORES:-0.15}" <<'PY'
import sys, time
from app.bench.loadgen.usage import machine_cpu_s
deadline, limit = time.monotonic() + float(sys.argv[1]), float(sys.argv[2])
while True:
    busy, _ = machine_cpu_s()
    time.sleep(2)
    cores = (machine_cpu_s()[0] - busy) / 2
    if cores < limit:
        print(f"the rest of the machine quiet before measuring: {cores:.2f} cores busy", file=sys.stderr)
        break
    if time.monotonic() > deadline:
        print(f"warning: the rest of the machine still busy after {sys.argv[1]} s: {cores:.2f} cores; "
              "measuring anyway (a limit measured so reads low, and flatters the ratio)", file=sys.stderr)
        break
PY
}
# (i) the model
export_model

# (ii) the limit, on the same images the load generator sends
if [ -n "${LIMIT_JSON:-}" ]; then  # reuse a limit measured before (its images must be in $out/images)
  cp "$LIMIT_JSON" "$out/limit.json"
else
  wait_quiet
  logged "$out/limit.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" --images-out "$out/images" \
    --seconds "${LIMIT_SECONDS:-2}" --out "$out/limit.json" >"$out/limit.md"
  cat "$out/limit.md"
fi
best_batch=$(field "$out/limit.json" "r['limit']['best_batch']")
serve_batch=$(field "$out/limit.json" "r['limit'].get('serve_batch', r['limit']['best_batch'])")

export AI_SERVICE_MODEL__REPOSITORY="$repo"
export AI_SERVICE_MODEL__NAMES="[\"$model\"]"
export AI_SERVICE_MODEL__DEFAULT="$model"
export AI_SERVICE_BATCHING__NORMAL__MAX_BATCH="${AI_SERVICE_BATCHING__NORMAL__MAX_BATCH:-$serve_batch}"

# start_server LOG [ENV=VALUE ...]: serve on $port from $SERVER_TREE (default: this checkout), with
# $SERVER_COMMAND (default serve; floor: the least HTTP possible)
start_server() {
  local log=$1 tree=$root
  shift
  for assignment in "$@"; do
    case $assignment in SERVER_TREE=*) tree=${assignment#SERVER_TREE=} ;; esac
  done
  refuse_taken_port
  (cd "$tree" && exec env "$@" "$py" -m app.cli "${SERVER_COMMAND:-serve}" --port "$port" >"$log" 2>&1) &
  server_pid=$!
  wait_ready "$log"
}

bench() {  # bench CONCURRENCY OUT_JSON [DURATION [nowait]]
  if [ "${4:-}" != nowait ]; then wait_quiet; fi
  "$py" -m app.cli bench --url "http://127.0.0.1:$port" --client raw --images "$out/images" \
    --concurrency "$1" --duration "${3:-$duration}" --warmup "$warmup" --urgent-fraction "${URGENT_FRACTION:-0}" \
    --server-pid "$server_pid" --server-metrics --out "$2" >/dev/null
}

if [ -n "${VARIANTS_ONLY:-}" ]; then  # only the side-by-side part, at VARIANT_CONCURRENCY
  saturated=${VARIANT_CONCURRENCY:?VARIANTS_ONLY needs VARIANT_CONCURRENCY}
else
  # (iii) + (iv) saturation
  start_server "$out/server.log"
  benches=()
  for c in $concurrencies; do
    bench "$c" "$out/bench-c$c.json"
    benches+=("$out/bench-c$c.json")
    echo "concurrency $c: $(field "$out/bench-c$c.json" \
      "f\"{r['throughput_rps']} requests/s, mean batch {r['mean_batch_size']}, other cores {r['cpu']['other_cores']}\"")"
  done
  saturated=$("$py" -c "import json, sys; print(max(sys.argv[1:], key=lambda p: json.load(open(p))['throughput_rps']))" \
    "${benches[@]}" | sed -E 's/.*-c([0-9]+)\.json$/\1/')

  # (v) the profile: a separate pass at the saturation point, so sampling does not touch the figures above
  pyspy=$(command -v py-spy || true)
  if [ -z "$pyspy" ]; then
    python3 -m pip install --quiet --target /tmp/py-spy py-spy && pyspy=/tmp/py-spy/bin/py-spy
  fi
  wait_quiet
  bench "$saturated" "$out/bench-profiled.json" "$((profile_seconds + 4))" nowait &
  bench_pid=$!
  sleep "$((warmup + 1))"
  "$py" -m app.bench.ratio profile --pid "$server_pid" --seconds "$profile_seconds" --py-spy "$pyspy" \
    --raw "$out/py-spy.txt" --out "$out/profile.json"
  wait "$bench_pid"
  stop_server

  # (vi) the same service, the same settings and images, no HTTP: what the layers in front cost
  wait_quiet
  "$py" -m app.bench.core --images "$out/images" --concurrency "$saturated" --seconds "$duration" \
    --warmup "$warmup" --out "$out/core.json" >/dev/null 2>"$out/core.log"
  # (vii) the same service behind the least HTTP possible
  SERVER_COMMAND=floor start_server "$out/floor.log"
  bench "$saturated" "$out/floor.json"
  stop_server

  # the limit again: the machines drift (other tenants), so the ratio is taken against both ends' mean
  if [ -z "${LIMIT_JSON:-}" ]; then
    wait_quiet
    logged "$out/limit-after.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" --images "$out/images" \
      --pipeline-seconds 0 --seconds "${LIMIT_SECONDS:-2}" --out "$out/limit-after.json" >/dev/null
    limit_after=(--limit-after "$out/limit-after.json")
  else
    limit_after=()
  fi

  config=("best_batch=$best_batch" "serve_batch=$serve_batch" "cores=$(nproc)")
  for name in $(env | grep -o '^AI_SERVICE_[A-Z_]*' | sort); do config+=("$name=${!name}"); done
  "$py" -m app.bench.ratio report --limit "$out/limit.json" "${limit_after[@]}" --bench "${benches[@]}" \
    --profile "$out/profile.json" --core "$out/core.json" --floor "$out/floor.json" \
    --profile-bench "$out/bench-profiled.json" --config "${config[@]}" --out-json "$out/ratio.json" --out-md "$out/ratio.md"

fi

# side by side variants, interleaved rounds at the saturation concurrency
if [ -n "${VARIANTS:-}" ]; then
  runs=()
  IFS=';' read -ra variants <<<"$VARIANTS"
  for round in $(seq 1 "${ROUNDS:-2}"); do
    # this round's limit (best batch only): each variant's ratio is taken against it
    wait_quiet
    logged "$out/limit-r$round.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" \
      --images "$out/images" --batch-sizes "$best_batch" --pipeline-seconds 0 --seconds "${LIMIT_SECONDS:-2}" \
      --out "$out/limit-r$round.json" >/dev/null
    for variant in "${variants[@]}"; do
      label=${variant%%:*}
      read -ra assignments <<<"${variant#*:}"
      start_server "$out/server-$label.log" "${assignments[@]}"
      bench "${VARIANT_CONCURRENCY:-$saturated}" "$out/variant-$label-r$round.json"
      stop_server
      runs+=("$label=$out/variant-$label-r$round.json@$out/limit-r$round.json")
      echo "variant $label round $round: $(field "$out/variant-$label-r$round.json" "r['throughput_rps']") requests/s"
    done
  done
  "$py" -m app.bench.ratio compare --limit "$out/limit.json" --run "${runs[@]}" \
    --out-json "$out/compare.json" --out-md "$out/compare.md"
fi
