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
logged() {  # logged LOG COMMAND...: stderr into LOG; on failure its last lines, and exit 1
  local log=$1
  shift
  if ! "$@" 2>"$log"; then
    echo "failed: $*; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
}
export_model() {  # the model, unless the repository holds it already
  if [ ! -d "$repo/$model" ]; then
    logged "${out:-/tmp}/export.log" "$py" -m app.cli export --arch "$model" --seed 0 --out "$repo" >/dev/null
  fi
}
command -v curl >/dev/null || { echo "curl is needed to poll the server's /readyz" >&2; exit 1; }
answers() {  # answers: something already answers /readyz on $port
  [ "$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "127.0.0.1:$port/readyz")" != 000 ]
}
refuse_taken_port() {  # before a server starts: another one there would be measured instead
  if answers; then echo "port $port already answers (a server left from an earlier run?)" >&2; exit 1; fi
}
wait_ready() {  # wait_ready LOG: until $server_pid (alive) answers ${ready_path:-/readyz} on $port with 200 (60 s at most)
  for _ in $(seq 1 600); do
    kill -0 "$server_pid" 2>/dev/null || { echo "server exited; see $1" >&2; exit 1; }
    if [ "$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "127.0.0.1:$port${ready_path:-/readyz}")" = 200 ]; then
      kill -0 "$server_pid" 2>/dev/null || { echo "server exited; see $1" >&2; exit 1; }
      return 0
    fi
    sleep 0.1
  done
  echo "server not ready after 60 s; see $1" >&2
  exit 1
}
