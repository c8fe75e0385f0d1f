# Shared by scripts/bench_ratio.sh and scripts/bench_load.sh (sourced, not run): the model
# repository (REPOSITORY, or a temporary one removed at exit, holding MODEL exported with seed 0),
# the server's stop, and reading a field of a JSON report. Needs $py set by the caller.
model=${MODEL:-mobilenet_v3_small}
repo=${REPOSITORY:-}
temporary_repo=""
if [ -z "$repo" ]; then
  repo=$(mktemp -d "/tmp/ai-backend-${BENCH_NAME:-bench}-XXXXXX")
  temporary_repo=$repo
fi
server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
cleanup() {
  stop_server
  if [ -n "$temporary_repo" ]; then rm -rf "$temporary_repo"; fi
}
trap cleanup EXIT
field() {  # field JSON_FILE PYTHON_EXPRESSION_OF_r
  "$py" -c "import json, sys; r = json.load(open(sys.argv[1])); print($2)" "$1"
}
export_model() {  # the model, unless the repository holds it already
  if [ ! -d "$repo/$model" ]; then
    "$py" -m app.cli export --arch "$model" --seed 0 --out "$repo" 2>/dev/null
  fi
}
wait_ready() {  # wait_ready LOG: until $server_pid answers /readyz on $port with 200 (60 s at most)
  for _ in $(seq 1 600); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$port/readyz")" = 200 ]; then return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "server exited; see $1" >&2; exit 1; }
    sleep 0.1
  done
  echo "server not ready after 60 s; see $1" >&2
  exit 1
}
