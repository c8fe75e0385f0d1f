#!/usr/bin/env bash
# Server variants measured in alternation, every one serving at once. Usage:
#   scripts/bench_alternate.sh OUT_DIR ROUNDS "label:ENV=V ENV2=V2;label2:ENV=V"
# The host under these machines drifts by a quarter within minutes, so a variant measured a minute
# after another is measured on another machine. Here every variant's server starts first (each on
# its own port), then each round measures them one after the other at saturation (closed loop,
# CONCURRENCY clients, 10% urgent, DURATION seconds each), a few seconds apart, and each variant's
# throughput is divided by the first variant's in the same round: the drift between rounds cancels
# in that ratio. While one is measured the others are stopped (SIGSTOP to each of their processes,
# SIGCONT after): an idle server may poll (an idle LitServe takes 0.16 cores), which the measured
# one would lose. Prints one line per round and a summary
# (median ratio and its range, and each lane's latency percentiles as medians over the rounds:
# app.bench.alternate, which also writes OUT_DIR/alternate.json); every other round runs them in
# reverse order. The bench reports go to OUT_DIR. A variant's SERVER_TREE=/path serves that checkout.
# Run it with the same variant twice ("a:X=1;b:X=2") to see the spread when nothing differs.
# A variant's RIVAL=litserve|ray|fastapi serves the same model another way (python -m app.bench.rivals:
# the same decode and forward pass, another serving layer), RIVAL_ARGS=--workers=2,--fast-queue
# its options (commas for spaces); the server's CPU then counts its child processes too.
# Knobs (environment): REPOSITORY (a model repository holding MODEL, default mobilenet_v3_small:
# exported there when missing), IMAGES (default out/images, made by `ai-backend limit`), MAX_BATCH
# (24, the normal lane's), CONCURRENCY (64), DURATION (6), WARMUP (2), URGENT_FRACTION (0.1), PORT
# (8953: the first variant's; the next ones count up). RATE (requests/s) measures open loop at that
# rate instead (Poisson arrivals, every request with a deadline of DEADLINE_MS, 1000): twice saturation
# compares what variants answer under overload. FRESH=1 starts each variant's server anew for each
# measurement and stops it after, so that every measurement meets a server's first load (its first
# minute: memory still growing, estimates still settling), one server up at a time. Loopback only,
# bounded in time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=$1 rounds=$2
IFS=';' read -ra variants <<<"$3"
mkdir -p "$out"
py="$root/.venv/bin/python"
images=${IMAGES:-out/images}
BENCH_NAME=alternate
# shellcheck source=scripts/bench_common.sh
source "$root/scripts/bench_common.sh"
# without pgrep, tree would name only each server's main process, and LitServe's or Ray's workers
# would go on running (and polling) while another server is measured
command -v pgrep >/dev/null || { echo "pgrep (procps) is needed to stop the idle servers' processes" >&2; exit 1; }
pids=()
tree() {  # tree PID: the process and every process under it
  local child
  echo "$1"
  for child in $(pgrep -P "$1"); do tree "$child"; done
}
signal_others() {  # signal_others SIGNAL INDEX: every variant's processes but INDEX's (all with -1)
  local j
  for j in "${!pids[@]}"; do
    if [ "$j" != "$2" ] && [ -n "${pids[$j]}" ]; then kill "-$1" $(tree "${pids[$j]}") 2>/dev/null || true; fi
  done
}
stop_all() {
  signal_others CONT -1
  for pid in "${pids[@]}"; do if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi; done
  for pid in "${pids[@]}"; do if [ -n "$pid" ]; then wait "$pid" 2>/dev/null || true; fi; done
  cleanup
}
trap stop_all EXIT
export_model
[ -d "$images" ] || logged "$out/limit.log" "$py" -m app.bench.limit --repository "$repo" --model "$model" \
  --images-out "$images" --batch-sizes 1 --seconds 0.1 --pipeline-seconds 0 --every-core-seconds 0 \
  --out "$out/limit.json" >/dev/null
export AI_SERVICE_MODEL__REPOSITORY="$repo" AI_SERVICE_MODEL__NAMES="[\"$model\"]" AI_SERVICE_MODEL__DEFAULT="$model"
export AI_SERVICE_BATCHING__NORMAL__MAX_BATCH="${MAX_BATCH:-24}"
first_port=${PORT:-8953}
start_variant() {  # start_variant INDEX [LOG_SUFFIX]: its server on its port, until it answers ready
  local i=$1 variant=${variants[$1]} tree=$root rival="" rival_args="" assignment
  local -a assignments extra
  read -ra assignments <<<"${variant#*:}"
  for assignment in "${assignments[@]}"; do
    case $assignment in
      SERVER_TREE=*) tree=${assignment#SERVER_TREE=} ;;
      RIVAL=*) rival=${assignment#RIVAL=} ;;
      RIVAL_ARGS=*) rival_args=${assignment#RIVAL_ARGS=} ;;
    esac
  done
  port=${ports[$i]}
  refuse_taken_port
  if [ -n "$rival" ]; then  # the same model served another way (app.bench.rivals)
    read -ra extra <<<"${rival_args//,/ }"
    command=(-m app.bench.rivals "$rival" --repository "$repo" --model "$model"
      --max-batch "$AI_SERVICE_BATCHING__NORMAL__MAX_BATCH" --port "$port" "${extra[@]}")
  else
    command=(-m app.cli serve --port "$port")
  fi
  local log="$out/server-${labels[$i]}${2:-}.log"
  (cd "$tree" && exec env "${assignments[@]}" "$py" "${command[@]}") >"$log" 2>&1 &
  server_pid=$!
  pids[i]=$server_pid
  ready_path=/readyz
  if [ "$rival" = litserve ]; then ready_path=/health; fi
  wait_ready "$log"
  server_pid=""  # stop_all stops it
}
stop_variant() {  # stop_variant INDEX: its server ended (FRESH)
  kill -TERM "${pids[$1]}" 2>/dev/null || true
  wait "${pids[$1]}" 2>/dev/null || true
  pids[$1]=""
}
labels=() ports=()
for i in "${!variants[@]}"; do
  labels+=("${variants[$i]%%:*}") ports+=($((first_port + i)))
  pids+=("")
done
if [ -z "${FRESH:-}" ]; then
  for i in "${!variants[@]}"; do start_variant "$i"; done
fi
if [ -n "${RATE:-}" ]; then
  load=(--rate "$RATE" --deadline-ms "${DEADLINE_MS:-1000}")
else
  load=(--concurrency "${CONCURRENCY:-64}")
fi
for round in $(seq 1 "$rounds"); do
  reports=()
  order=("${!labels[@]}")
  if ((round % 2 == 0)); then  # every other round in reverse (A B, B A): going first or second is no one's
    for ((j = 0, k = ${#order[@]} - 1; j < k; j++, k--)); do
      swap=${order[$j]} order[j]=${order[$k]} order[k]=$swap
    done
  fi
  for i in "${order[@]}"; do
    report="$out/${labels[$i]}-$round.json"
    if [ -n "${FRESH:-}" ]; then
      start_variant "$i" "-$round"  # a new server for each measurement, the only one up
    else
      signal_others STOP "$i"  # the others frozen while one is measured: an idle server may poll
    fi
    "$py" -m app.cli bench --url "http://127.0.0.1:${ports[$i]}" --client raw --images "$images" \
      --server-pid "${pids[$i]}" --urgent-fraction "${URGENT_FRACTION:-0.1}" "${load[@]}" \
      --duration "${DURATION:-6}" --warmup "${WARMUP:-2}" --out "$report" >/dev/null
    if [ -n "${FRESH:-}" ]; then stop_variant "$i"; else signal_others CONT "$i"; fi
    reports+=("${labels[$i]}=$report")
  done
  "$py" -m app.bench.alternate round "$round" "$(IFS=,; echo "${labels[*]}")" "${reports[@]}"
done
"$py" -m app.bench.alternate summary "$out" "$rounds" "${labels[@]}"
