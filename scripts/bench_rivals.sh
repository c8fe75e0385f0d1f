#!/usr/bin/env bash
# ai-backend side by side with other ways to serve the same model: the same images, the same decode
# and forward pass (python -m app.bench.rivals: LitServe, Ray Serve, plain FastAPI), another serving
# layer. Usage:
#   scripts/bench_rivals.sh OUT_DIR
# Three measurements, each with every server up and measured in alternation, the idle ones stopped
# (scripts/bench_alternate.sh, which says how), each server's CPU with its child processes':
#   OUT_DIR/saturation  closed loop, CONCURRENCY (128) clients, plain traffic, ROUNDS (4) rounds;
#   OUT_DIR/half        open loop at half of ai-backend's saturation (measured just before), 10% urgent,
#                       every request with a deadline of DEADLINE_MS (1000): latency by lane;
#   OUT_DIR/twice-N     open loop at twice ai-backend's saturation, OVERLOAD_ROUNDS (2) runs of one round
#                       on fresh servers (a server with no admission control is left with a backlog that
#                       the next round would start behind), ai-backend and OVERLOAD_RIVALS (litserve ray): what
#                       each answers within the deadline.
# RIVALS (default "litserve ray fastapi"), WORKERS (LitServe's worker processes and Ray Serve's
# replicas; default the cores), and
# bench_alternate.sh's knobs (REPOSITORY, IMAGES: by default OUT_DIR/repository, OUT_DIR/images, made
# when missing; MAX_BATCH, DURATION, WARMUP, PORT). Loopback only,
# bounded in time (about 3 minutes a rival on these 2 cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:?usage: scripts/bench_rivals.sh OUT_DIR}
mkdir -p "$out"
py="$root/.venv/bin/python"
# exported (and the images made) once, by the first run, for all of them
export REPOSITORY=${REPOSITORY:-$out/repository} IMAGES=${IMAGES:-$out/images}
workers=${WORKERS:-$(nproc)}
variants() {  # variants RIVAL...: ai-backend first (every ratio is against it), then each rival
  local list="ai-backend:X=1" rival
  for rival in "$@"; do
    case $rival in
      litserve) list+=";litserve:RIVAL=litserve RIVAL_ARGS=--workers=$workers" ;;
      # Serve's proxy turns clients away from a replica at its max_ongoing_requests and backs off,
      # leaving cores idle: room for every client (the helper measured 52.5 requests/s at 96 slots
      # with 128 clients, 153.8 at 256)
      ray) list+=";ray:RIVAL=ray RIVAL_ARGS=--replicas=$workers,--max-ongoing-requests=256" ;;
      *) list+=";$rival:RIVAL=$rival" ;;
    esac
  done
  echo "$list"
}
read -ra rivals <<<"${RIVALS:-litserve ray fastapi}"
read -ra overload_rivals <<<"${OVERLOAD_RIVALS:-litserve ray}"
rounds=${ROUNDS:-4}
echo "== saturation: closed loop, ${CONCURRENCY:-128} clients, plain traffic"
CONCURRENCY=${CONCURRENCY:-128} URGENT_FRACTION=0 scripts/bench_alternate.sh "$out/saturation" "$rounds" \
  "$(variants "${rivals[@]}")"
saturation=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['ai-backend']['median_rps'])" \
  "$out/saturation/alternate.json")
half=$("$py" -c "import sys; print(round(float(sys.argv[1]) / 2))" "$saturation")
twice=$("$py" -c "import sys; print(round(float(sys.argv[1]) * 2))" "$saturation")
echo "== half of ai-backend's saturation ($saturation requests/s): $half requests/s, 10% urgent"
RATE=$half URGENT_FRACTION=0.1 scripts/bench_alternate.sh "$out/half" "$rounds" "$(variants "${rivals[@]}")"
for run in $(seq 1 "${OVERLOAD_ROUNDS:-2}"); do
  echo "== twice ai-backend's saturation: $twice requests/s, 10% urgent (run $run)"
  RATE=$twice URGENT_FRACTION=0.1 scripts/bench_alternate.sh "$out/twice-$run" 1 "$(variants "${overload_rivals[@]}")"
done
