#!/usr/bin/env bash
# Server variants side by side under the same load, interleaved. Usage:
#   scripts/bench_variants.sh OUT_DIR RATE ROUNDS "label:ENV=V ENV2=V2;label2:ENV=V"
# Each round serves every variant in turn (ai-backend serve with its settings as environment
# variables) and measures, against it: saturation (closed loop, 64 clients, 10 s) and open loop
# (Poisson) at RATE requests/s for STEADY_SECONDS (25), both with 10% urgent requests. Prints one
# line per variant and round; the bench reports go to OUT_DIR. Loopback only, bounded in time.
# RATE "2x": the open loop runs at twice each variant's own saturation, for OVERLOAD_SECONDS (30),
# every request with a deadline of DEADLINE_MS (1000), and the line gives the share of saturation
# answered, the mean batch per lane, the answers later than their deadline and the cores each group
# of the server's threads used (and waited for).
# Knobs (environment): REPOSITORY (a model repository holding MODEL, default mobilenet_v3_small:
# exported there when missing), IMAGES (default out/images, made by `ai-backend limit`), MAX_BATCH
# (24, the normal lane's), PORT (8943). A variant's SERVER_TREE=/path serves that checkout instead of this one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=$1 rate=$2 rounds=$3
IFS=';' read -ra variants <<<"$4"
mkdir -p "$out"
py="$root/.venv/bin/python"
port=${PORT:-8943}
images=${IMAGES:-out/images}
BENCH_NAME=variants
# shellcheck source=scripts/bench_common.sh
source "$root/scripts/bench_common.sh"
export_model
[ -d "$images" ] || logged "$out/limit.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" \
  --images-out "$images" --batch-sizes 1 --seconds 0.1 --pipeline-seconds 0 --every-core-seconds 0 \
  --out "$out/limit.json" >/dev/null
export AI_SERVICE_MODEL__REPOSITORY="$repo" AI_SERVICE_MODEL__NAMES="[\"$model\"]" AI_SERVICE_MODEL__DEFAULT="$model"
export AI_SERVICE_BATCHING__NORMAL__MAX_BATCH="${MAX_BATCH:-24}"
bench() {
  "$py" -m app.cli bench --url "http://127.0.0.1:$port" --client raw --images "$images" --server-pid "$server_pid" \
    --urgent-fraction 0.1 --out "$@" >/dev/null
}
for round in $(seq 1 "$rounds"); do
  for variant in "${variants[@]}"; do
    label=${variant%%:*}
    read -ra assignments <<<"${variant#*:}"
    tree=$root  # SERVER_TREE=/path serves another checkout (a git worktree of the base commit, say)
    for assignment in "${assignments[@]}"; do
      case $assignment in SERVER_TREE=*) tree=${assignment#SERVER_TREE=} ;; esac
    done
    refuse_taken_port
    (cd "$tree" && exec env "${assignments[@]}" "$py" -m app.cli serve --port "$port") >"$out/server-$label.log" 2>&1 &
    server_pid=$!
    wait_ready "$out/server-$label.log"
    bench "$out/saturation-$label-$round.json" --concurrency 64 --duration 10 --warmup 3
    if [ "$rate" = 2x ]; then
      twice=$(field "$out/saturation-$label-$round.json" "round(2 * r['throughput_rps'], 1)")
      bench "$out/steady-$label-$round.json" --rate "$twice" --deadline-ms "${DEADLINE_MS:-1000}" \
        --duration "${OVERLOAD_SECONDS:-30}" --warmup 3
    else
      bench "$out/steady-$label-$round.json" --rate "$rate" --duration "${STEADY_SECONDS:-25}" --warmup 3
    fi
    stop_server
    "$py" - "$out" "$label" "$round" "$rate" <<'PY'
import json
import sys

out, label, round_, rate = sys.argv[1:]
sat = json.load(open(f"{out}/saturation-{label}-{round_}.json"))
steady = json.load(open(f"{out}/steady-{label}-{round_}.json"))
line = f"{label} round {round_}: saturation {sat['throughput_rps']:.1f}/s | at {steady['rate_rps']}/s: "
if rate == "2x":
    threads = " ".join(
        f"{name} {t['cpu_cores']:.2f} (waited {t['runnable_waiting_cores']:.2f})"
        for name, t in steady.get("server_threads", {}).items()
        if t["cpu_cores"] > 0.01
    )
    line += (
        f"answered {steady['throughput_rps']:.1f}/s = {steady['throughput_rps'] / sat['throughput_rps']:.3f}, "
        f"mean batch by request lane {steady['mean_batch_size_by_request_lane']}, late {steady.get('ok_past_deadline')} | cores: {threads}"
    )
else:
    urgent, normal = steady["latency"]["urgent"], steady["latency"]["normal"]
    line += (
        f"urgent p50/p99 {urgent['p50_ms']:.1f}/{urgent['p99_ms']:.1f} ms, normal p50/p99 "
        f"{normal['p50_ms']:.1f}/{normal['p99_ms']:.1f} ms, mean batch {steady['mean_batch_size']}"
    )
print(line, flush=True)
PY
  done
done
