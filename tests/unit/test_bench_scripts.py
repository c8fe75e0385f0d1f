"""The bench scripts' failure paths: what they say when a step fails, and whose server they measure."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _fake_tree(
    tmp_path: Path, python_body: str, scripts: tuple[str, ...] = ("bench_ratio.sh", "bench_common.sh")
) -> Path:
    """A copy of the bench ``scripts`` beside a stand-in ``.venv/bin/python`` (a shell script)."""
    import shutil
    import stat

    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy(SCRIPTS / name, tree / "scripts" / name)
    python = tree / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/usr/bin/env bash\n" + python_body)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tree


def test_bench_ratio_says_why_when_the_limit_fails(tmp_path: Path) -> None:

    tree = _fake_tree(
        tmp_path,
        'if [ "${1:-}" = - ]; then cat >/dev/null; exit 0; fi\n'  # wait_quiet
        'if [ "${2:-}" = app.bench.limit ]; then\n'
        "  echo \"ai-backend limit: model 'mobilenet_v3_small' is not in /repo (it holds: none)\" >&2; exit 1\n"
        "fi\nexit 0\n",
    )
    repo = tmp_path / "repo"
    (repo / "mobilenet_v3_small").mkdir(parents=True)
    env = {**os.environ, "REPOSITORY": str(repo), "QUIET_WAIT": "0"}
    done = subprocess.run(
        ["bash", str(tree / "scripts" / "bench_ratio.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    # the run stops at step (ii); the one line that says why must reach the user
    assert "is not in /repo" in done.stderr + done.stdout, done.stderr


def test_wait_ready_does_not_take_another_process_on_the_port_for_a_server_that_died(tmp_path: Path) -> None:
    """A server that dies at start (its port taken by a stale server from an earlier run) is
    not ready: the bench would measure the other process."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    stale = HTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=stale.serve_forever, daemon=True).start()
    try:
        dead = subprocess.Popen(["true"])
        dead.wait()  # our server: exited (address in use)
        script = (
            f'py=true; REPOSITORY="{tmp_path}/repository"; source "{SCRIPTS}/bench_common.sh"; trap - EXIT; '
            f"port={stale.server_address[1]}; "
            f'server_pid={dead.pid}; wait_ready "{tmp_path}/server.log"'
        )
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=90, check=False)
    finally:
        stale.shutdown()
        stale.server_close()
    assert done.returncode != 0, "wait_ready returned ready for a server that had exited"
    assert "server exited" in done.stderr


FAKE_SERVER = """
import http.server, os, subprocess, sys
with open(os.environ["FAKE_PIDS"], "a") as pids:
    print(os.getpid(), file=pids)
litserve = sys.argv[1:3] == ["app.bench.rivals", "litserve"]
ready = "/health" if litserve else "/readyz"
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen(["sleep", "300"])  # a worker process, as LitServe's
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == ready else 404)
        self.end_headers()
    def log_message(self, *_):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Handler)
import signal
def stop(*_):
    child.kill()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
server.serve_forever()
"""

FAKE_PYTHON = """log="$FAKE_LOG"
case "$1 $2" in
  "-m app.cli")
    if [ "$3" = serve ]; then echo "serve $*" >>"$log"; exec "$REAL_PY" -c "$FAKE_SERVER" app.cli "${@:3}"; fi
    if [ "$3" = bench ]; then
      out="" pid=""
      while [ $# -gt 0 ]; do case $1 in --out) out=$2 ;; --server-pid) pid=$2 ;; esac; shift; done
      for server in $(cat "$FAKE_PIDS"); do  # each server's processes' states: T is stopped
        for p in $server $(pgrep -P "$server"); do
          echo "bench $pid sees $server $p $(ps -o stat= -p "$p")" >>"$log"
        done
      done
      if [ -n "${FAKE_BENCH_END:-}" ] && [ -e "$log.measured" ]; then  # the second measurement
        case $FAKE_BENCH_END in fail) exit 3 ;; hang) touch "$log.hanging"; sleep 60 ;; esac
      fi
      touch "$log.measured"
      echo '{"throughput_rps": 10.0, "cpu": {"server_ms_per_request": 1.0}, "latency": {}}' >"$out"
      exit 0
    fi ;;
  "-m app.bench.rivals") echo "rival $*" >>"$log"; exec "$REAL_PY" -c "$FAKE_SERVER" app.bench.rivals "${@:3}" ;;
  "-m app.bench.alternate") exec "$REAL_PY" "$@" ;;
esac
echo "unexpected: $*" >>"$log"; exit 1
"""


def _alternate_tree(tmp_path: Path, **extra: str) -> tuple[Path, Path, Path, dict[str, str]]:
    """bench_alternate.sh beside the stand-in python, a model repository and images for it: the
    tree, the calls' log, the servers' pid file, and the environment to run it in."""
    import sys

    tree = _fake_tree(tmp_path, FAKE_PYTHON, ("bench_alternate.sh", "bench_common.sh"))
    (tmp_path / "repo" / "mobilenet_v3_small").mkdir(parents=True)
    (tmp_path / "images").mkdir()
    log, pids = tmp_path / "calls.log", tmp_path / "pids"
    env = {
        **os.environ,
        "REAL_PY": sys.executable,
        "PYTHONPATH": str(SCRIPTS.parent),
        "FAKE_SERVER": FAKE_SERVER,
        "FAKE_LOG": str(log),
        "FAKE_PIDS": str(pids),
        "REPOSITORY": str(tmp_path / "repo"),
        "IMAGES": str(tmp_path / "images"),
        "PORT": str(_free_port_pair()),
        **extra,
    }
    return tree, log, pids, env


def _alternate(tmp_path: Path, variants: str, **extra: str) -> tuple[str, list[str]]:
    """bench_alternate.sh run for two rounds with stand-in servers, to its end: the calls' log and
    the pids of the servers it started."""
    tree, log, pids, env = _alternate_tree(tmp_path, **extra)
    done = subprocess.run(
        ["bash", str(tree / "scripts" / "bench_alternate.sh"), str(tmp_path / "out"), "2", variants],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    calls = log.read_text()
    assert done.returncode == 0, done.stderr + calls
    return calls, pids.read_text().split()


def test_bench_alternate_serves_a_rival_and_stops_the_other_servers_while_one_is_measured(tmp_path: Path) -> None:
    """Every other variant's processes (its children too) are stopped while one is measured, then
    continued; a rival is started with its options and waited for on its own ready path; nothing
    is left running after."""
    calls, servers = _alternate(tmp_path, "ours:X=1;lit:RIVAL=litserve RIVAL_ARGS=--workers=2,--fast-queue")
    assert len(servers) == 2, calls
    rival = next(line for line in calls.splitlines() if line.startswith("rival "))
    assert "litserve --repository" in rival and rival.endswith("--workers=2 --fast-queue") and "--max-batch 24" in rival
    seen = [line.split() for line in calls.splitlines() if line.startswith("bench ")]
    assert len(seen) == 2 * 2 * 2 * 2  # 2 rounds x 2 measured x 2 servers x (server + child)
    for _, measured, _, server, process, state in seen:
        assert state.startswith("T") == (server != measured), calls
    for process in (int(p) for _, _, _, _, p, _ in seen):
        assert _state(process) in (None, "Z"), process  # gone, or ended and not yet collected


def test_bench_alternate_fresh_starts_a_new_server_for_each_measurement_the_only_one_up(tmp_path: Path) -> None:
    """FRESH=1: every measurement meets a server started for it (a server's first minute is what
    the fresh runs judge), stopped after it; none of the others is up meanwhile, each server's log
    is its own, and nothing is left running."""
    calls, servers = _alternate(tmp_path, "old:X=1;new:X=2", FRESH="1")
    assert len(servers) == 2 * 2, calls  # 2 rounds x 2 variants, each a server of its own
    assert calls.count("serve -m app.cli serve") == 4
    measured = [line.split() for line in calls.splitlines() if line.startswith("bench ")]
    assert {int(m[1]) for m in measured} == {int(pid) for pid in servers}, "each measurement on its own server"
    for _, server_measured, _, server, _, *state in measured:
        if server != server_measured:  # any other server is gone by then (or never started yet)
            assert not state or state[0].startswith("Z"), calls
    for label in ("old", "new"):
        for round_ in (1, 2):
            assert (tmp_path / "out" / f"server-{label}-{round_}.log").exists()
    for process in (int(p) for p in servers):
        assert _state(process) in (None, "Z"), process


def _free_port_pair() -> int:
    """A loopback port with the one above it free too (the script numbers its servers up from PORT)."""
    import socket

    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.parametrize("end", ["fail", "hang"])
def test_bench_alternate_leaves_no_server_stopped_or_running_when_a_measurement_fails_or_is_interrupted(
    tmp_path: Path, end: str
) -> None:
    """The second measurement (the rival's, the first server stopped meanwhile) fails, or hangs
    and the run is interrupted (Ctrl+C: SIGINT to the whole process group): the script must end
    at once, every stopped server continued and ended, not one left stopped (a stopped server
    never acts on SIGTERM: waiting for it would hang) nor running."""
    import signal
    import sys
    import time

    tree, log, pids, env = _alternate_tree(tmp_path, FAKE_BENCH_END=end)
    # as from a terminal: SIGINT acted on (this process may have been started ignoring it)
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execvp('bash', ['bash', *sys.argv[1:]])"
    )
    command = [sys.executable, "-c", as_from_a_terminal, str(tree / "scripts" / "bench_alternate.sh")]
    command += [str(tmp_path / "out"), "1", "ours:X=1;lit:RIVAL=litserve"]
    script = subprocess.Popen(
        command, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    seen: set[int] = set()
    try:
        if end == "hang":
            deadline = time.monotonic() + 60
            while not Path(f"{log}.hanging").exists() and script.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert Path(f"{log}.hanging").exists(), log.read_text() if log.exists() else "no calls"
            os.killpg(script.pid, signal.SIGINT)
        _, stderr = script.communicate(timeout=30)
        seen = {int(line.split()[4]) for line in log.read_text().splitlines() if line.startswith("bench ")}
        assert script.returncode != 0
        assert len(seen) == 4, log.read_text()  # two servers, each with its child
        deadline = time.monotonic() + 10
        while (left := [pid for pid in seen if _state(pid) not in (None, "Z")]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, [(pid, _state(pid)) for pid in left]
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.communicate(timeout=10)
        for pid in seen | {int(p) for p in (pids.read_text().split() if pids.exists() else [])}:
            if _state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str | None:
    """A process's state letter (``T`` stopped, ``Z`` ended), None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None
