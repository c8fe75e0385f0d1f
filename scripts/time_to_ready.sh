#!/usr/bin/env bash
# Seconds from `ai-backend serve` starting to /readyz answering 200. Usage: scripts/time_to_ready.sh [port]
set -euo pipefail
port=${1:-8019}
start=$(date +%s.%N)
.venv/bin/ai-backend serve --port "$port" >/tmp/time_to_ready.log 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  if [ "$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$port/readyz")" = 200 ]; then
    echo "ready after $(echo "$(date +%s.%N) - $start" | bc) s"
    exit 0
  fi
  sleep 0.05
done
echo "not ready after 30 s" >&2
exit 1
