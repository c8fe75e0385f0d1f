"""``ai-backend`` subcommands end with a message and their exit code, never a traceback:
2 for a bad setting or argument, 1 for a start that failed."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.server import signalled_as_it_starts
from tests.support import REPO_ROOT, server_environment

SERVE_TIMEOUT_S = 90
TEXT = {"AI_SERVICE_LOGGING__JSON_FORMAT": "false"}  # the log in plain text, for a terminal


def json_records(stderr: str) -> list[dict[str, object]]:
    """Each line of ``stderr`` as the JSON object it must be: a collector reading the log's stream
    gets nothing else (a plain line fails here, naming it)."""
    records = []
    for line in stderr.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a line that is not JSON on the JSON log's stream: {line!r}")
    return records


def messages(stderr: str) -> list[str]:
    return [str(record["message"]) for record in json_records(stderr)]


def _serve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve"],
        check=False,
        cwd=REPO_ROOT,
        env=server_environment(env),
        capture_output=True,
        text=True,
        timeout=SERVE_TIMEOUT_S,
    )


def test_a_missing_admin_token_file_exits_2_naming_the_setting_without_a_traceback(tmp_path: Path) -> None:
    run = _serve(
        {
            "PYTHONPATH": str(REPO_ROOT),
            "AI_SERVICE_SERVER__PORT": "0",  # any free one: it never gets as far as binding it
            "AI_SERVICE_ADMIN__ENABLED": "true",
            "AI_SERVICE_ADMIN__TOKEN_FILE": str(tmp_path / "no-such-token"),
        }
    )
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr
    assert "AI_SERVICE_ADMIN__TOKEN_FILE" in run.stderr or "admin.token_file" in run.stderr


@pytest.mark.parametrize("json_format", [True, False], ids=["json", "text"])
def test_a_port_in_use_exits_with_the_clis_start_up_failure_code(json_format: bool) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"PYTHONPATH": str(REPO_ROOT), "AI_SERVICE_SERVER__PORT": str(port)}
        run = _serve(env if json_format else env | TEXT)
    assert run.returncode == 1, (run.returncode, run.stderr[-1500:])
    said = f"start-up failed: the server could not start on 127.0.0.1:{port}"
    if json_format:
        assert messages(run.stderr).count(said) == 1, run.stderr[-1500:]
    else:
        assert run.stderr.strip().splitlines()[-1] == f"ai-backend: {said}"


@pytest.mark.parametrize("json_format", [True, False], ids=["json", "text"])
def test_a_refused_setting_is_said_in_the_logs_format(json_format: bool, tmp_path: Path) -> None:
    """The settings were refused, so the format is read from the logging group alone: here from
    a config file, which a refused variable elsewhere does not stop being read."""
    config = tmp_path / "serve.toml"
    config.write_text(f"[logging]\njson_format = {str(json_format).lower()}\n")
    env = {"PYTHONPATH": str(REPO_ROOT), "AI_SERVICE_SERVER__PORT": "http", "AI_SERVICE_CONFIG_FILE": str(config)}
    run = _serve(env)
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    if json_format:
        (record,) = json_records(run.stderr)
        assert record["level"] == "ERROR" and str(record["message"]).startswith("invalid settings:")
        assert "AI_SERVICE_SERVER__PORT" in str(record["message"])
    else:
        lines = run.stderr.strip().splitlines()
        assert lines[0] == "ai-backend: invalid settings:" and "AI_SERVICE_SERVER__PORT" in lines[1]


def test_a_device_that_is_not_here_exits_2_in_one_line_before_the_server_starts() -> None:
    """Checked as the secrets are: from the app's start-up the line came with uvicorn's 30-line
    traceback, and exit 1 as for a start that failed, where it is a setting to change."""
    import torch  # here: the other tests need no torch in the test process

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {"PYTHONPATH": str(REPO_ROOT), "AI_SERVICE_SERVER__PORT": "0", "AI_SERVICE_MODEL__DEVICE": "cuda"}
    said = "model.device=cuda but CUDA is not available on this machine"
    run = _serve(env | TEXT)
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    assert run.stderr.strip().splitlines() == [f"ai-backend: {said}"]
    run = _serve(env)  # the JSON log, the default
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    assert messages(run.stderr) == [said]


# ``serve`` with its own check of the device left out, as if the device went between that check
# and the app's start-up: the app's start-up names it (exit 1), and uvicorn's traceback is left out
_DEVICE_UNCHECKED = """
import sys

from app import cli

cli._missing_device = lambda setting: None
sys.exit(cli.main(["serve"]))
"""


def test_a_start_up_failure_the_app_named_comes_without_uvicorn_s_traceback(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    script = tmp_path / "serve.py"
    script.write_text(_DEVICE_UNCHECKED)
    said = "start-up failed: model.device=cuda but CUDA is not available on this machine"
    for json_format in (False, True):
        env = {"PYTHONPATH": str(REPO_ROOT), "AI_SERVICE_SERVER__PORT": "0", "AI_SERVICE_MODEL__DEVICE": "cuda"}
        run = subprocess.run(
            [sys.executable, str(script)],
            check=False,
            cwd=REPO_ROOT,
            env=server_environment(env if json_format else env | TEXT),
            capture_output=True,
            text=True,
            timeout=SERVE_TIMEOUT_S,
        )
        assert run.returncode == 1, (run.returncode, run.stderr[-1500:])
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
        assert "could not start on" not in run.stderr, "the device named, not the address"
        if json_format:  # logged once, by the app: not once more at exit
            assert messages(run.stderr).count(said) == 1, run.stderr[-3000:]
        else:  # logged by the app, and said again as the last line a person reads
            assert run.stderr.strip().splitlines()[-1] == f"ai-backend: {said}"


@pytest.mark.parametrize(
    "env",
    [
        {"AI_SERVICE_MODEL__REPOSITORY": "/nonexistent/models"},
        {"AI_SERVICE_SERVER__PORT": "http"},
    ],
    ids=["missing-repository", "invalid-setting"],
)
def test_core_reports_a_bad_setup_without_a_traceback(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from app.bench import core

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    samples = str(REPO_ROOT / "models" / "digits" / "samples")
    code = core.main(["--images", samples, "--seconds", "0.2", "--warmup", "0", "--concurrency", "1"])
    assert code == (2 if "PORT" in next(iter(env)) else 1)


def test_eval_on_a_read_only_repository_reports_it_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # root ignores file modes: the read-only mount is where the temporary manifest is made
    import errno
    import tempfile

    from app.lifecycle import evaluate
    from tests.support import copy_repository

    root = copy_repository(tmp_path)

    def read_only(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    code = evaluate.main(
        ["--model", "digits", "--version", "1", "--repository", str(root), "--limit", "8", "--device", "cpu"]
    )
    assert code == 1
    assert "Read-only" in capsys.readouterr().err


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``ai-backend ARGS`` from this checkout, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        check=False,
        cwd=REPO_ROOT,
        env=server_environment({"PYTHONPATH": str(REPO_ROOT)}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_floor_refuses_a_port_out_of_range_instead_of_hanging() -> None:
    try:
        run = _cli("floor", "--port", "99999", timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("ai-backend floor --port 99999 hung for 45 s without a word")
    assert run.returncode == 2, run.stderr[-1500:]


def test_bench_against_a_port_where_nothing_listens_exits_1_at_once() -> None:
    # a typo in --url: every request failed at once, the clients spun through tens of thousands
    # of refused connections, and the run exited 0 with "ok": 0
    with socket.socket() as bound:  # bound and not listening: connections are refused, nobody else can bind it
        bound.bind(("127.0.0.1", 0))
        run = _cli("bench", "--url", f"http://127.0.0.1:{bound.getsockname()[1]}", "--duration", "5", timeout=60)
    assert run.returncode == 1, (run.returncode, run.stderr[-1500:])
    assert "nothing answers at http://127.0.0.1:" in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == "", "no report for a run that never started"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see the handler set")
def test_sigterm_while_serve_starts_up_exits_0_saying_so() -> None:
    """A deploy may stop a pod that is still importing torch: the process says so and exits 0,
    as a drain with nothing to drain does (it died by the signal, -15, with no word)."""
    code, stderr = signalled_as_it_starts(signal.SIGTERM, SERVE_TIMEOUT_S)
    assert code == 0, (code, stderr[-2000:])
    assert "Traceback" not in stderr
    # the handler is set before torch's seconds-long import: the signal comes well before uvicorn's
    assert "SIGTERM before the server started: stopped" in messages(stderr), stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc to see the handler set")
def test_ctrl_c_before_the_server_starts_exits_130_without_a_traceback() -> None:
    """A Ctrl-C while torch imports printed a 40-line KeyboardInterrupt traceback, and the process
    died by the signal rather than exiting 130 as a Ctrl-C while serving does."""
    code, stderr = signalled_as_it_starts(signal.SIGINT, SERVE_TIMEOUT_S)
    assert code == 130, (code, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    assert "interrupted before the server started" in messages(stderr), stderr[-2000:]


# ``serve``, with a warm-up that stays inside torch (the GIL released) until the process ends, as
# a large model's warm-up at a large batch does on a CPU, and the shutdown's joins of the
# service's threads giving up at once instead of after their 10 s
_WARM_UP_IN_TORCH = """
import sys

import torch

from app.inference import loader, workers


@torch.jit.script
def _spin(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x + 1
    return x


def warm_up(self, max_batch, rounds=3, sizes=None):
    print("warm-up began", file=sys.stderr, flush=True)
    _spin(torch.zeros(1), 10**12)


loader.LayeredModel.warm_up = warm_up
workers.WorkerThreads.close.__defaults__ = (0.2, False)
from app.cli import main

sys.exit(main(["serve"]))
"""


def test_sigterm_while_a_device_thread_is_inside_torch_still_exits_0(tmp_path: Path) -> None:
    """A SIGTERM during a long warm-up (or a batch longer than the shutdown waits for): the
    thread is still inside torch when the process ends. Ending the interpreter then aborted it
    ("terminate called without an active exception", exit -6) instead of exiting 0."""
    from tests.support import copy_repository

    env = {
        "PYTHONPATH": str(REPO_ROOT),
        "AI_SERVICE_SERVER__PORT": "0",
        "AI_SERVICE_MODEL__REPOSITORY": str(copy_repository(tmp_path)),
        "AI_SERVICE_MODEL__DEVICE_WORKERS": "1",  # one thread spins, not one a core
        "AI_SERVICE_MODEL__URGENT_WORKERS": "0",
    }
    script, log = tmp_path / "serve.py", tmp_path / "stderr.log"
    script.write_text(_WARM_UP_IN_TORCH)  # a file: TorchScript reads the source of what it compiles
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO_ROOT,
            env=server_environment(env),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while "warm-up began" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(timeout=SERVE_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    output = log.read_text()
    assert returncode == 0, (returncode, output[-2000:])
    assert "terminate called" not in output


def _argument_error(main: Callable[[list[str]], int], argv: list[str]) -> str:
    """The message of the usage error (exit 2) that ``main(argv)`` ends with, before any work."""
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as err:
        main(argv)
    assert exited.value.code == 2, err.getvalue()
    return err.getvalue()


def test_bad_output_paths_and_arguments_are_refused_before_any_work(tmp_path: Path) -> None:
    """Found by a walk through the tools: each ran its whole work first (an export, a measurement)
    and then ended in a traceback, or ran at all, or named the wrong reason."""
    from app.bench import core
    from app.bench.limit import cli as limit
    from app.bench.loadgen import cli as bench
    from app.inference import export
    from app.lifecycle import evaluate
    from app.training import digits

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    samples = str(REPO_ROOT / "models" / "digits" / "samples")
    for argv in (["--out", str(tmp_path)], ["--out", str(a_file / "core.json")]):
        assert "--out" in _argument_error(core.main, ["--images", samples, *argv])
    assert "is not a directory" in _argument_error(export.main, ["--arch", "resnet18", "--out", str(a_file)])
    message = _argument_error(export.main, ["--arch", "resnet18", "--seed", "0", "--weights", str(a_file)])
    assert "not allowed with" in message  # --seed 0 is given, though it is the default's value
    under_a_file = ["--url", "http://127.0.0.1:9", "--out", str(a_file / "x.json")]
    assert f"{a_file} is not a directory" in _argument_error(bench.main, under_a_file)  # not "File exists"
    sizes = _argument_error(limit.main, ["--batch-sizes", "a,b"])
    assert "batch sizes are positive integers" in sizes and "_sizes" not in sizes
    assert "--epochs must be 1 or more" in _argument_error(digits.main, ["--out", str(tmp_path), "--epochs", "0"])
    assert "unknown precision 'int8'" in _argument_error(
        evaluate.main, ["--model", "digits", "--version", "1", "--precisions", "int8"]
    )
