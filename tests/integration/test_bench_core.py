"""``ai-backend core``: the real service driven in process with no HTTP, on the digits model."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.bench import core
from tests.conftest import SettingsFactory
from tests.support import SAMPLES_DIR, sample_png


def _service_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("preprocess", "device"))]


async def test_the_service_answers_closed_loop_clients_and_the_report_accounts_for_them(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(batching={"normal": {"window_ms": 5.0, "max_batch": 4}})
    images = [sample_png(d) for d in range(10)]
    before = _service_threads()
    report = await core.measure(settings, images, concurrency=8, seconds=0.6, warmup_s=0.2)
    assert report["model"] == "digits" and report["concurrency"] == 8 and report["errors"] == {}
    assert report["requests"] > 0
    assert report["throughput_rps"] == pytest.approx(report["requests"] / report["seconds"], rel=0.01)
    assert 1.0 <= report["mean_batch_size"] <= 4.0, "batches of the lane's max batch at most"
    cpu = report["cpu"]
    assert cpu["ms_per_request"] > 0 and cpu["cores"] > 0
    assert "event loop" in cpu["threads_ms_per_request"], "the main thread is named for what it runs"
    assert sum(cpu["threads_ms_per_request"].values()) <= cpu["ms_per_request"] * 1.01 + 1.0
    assert _service_threads() == before, "the service was closed: its decode and device threads are gone"
    assert "requests/s, mean batch" in core.markdown(report)


async def test_a_refused_image_is_counted_by_its_code_and_the_others_are_still_answered(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(batching={"normal": {"window_ms": 5.0, "max_batch": 4}})
    report = await core.measure(settings, [sample_png(1), b"not an image"], concurrency=4, seconds=0.6, warmup_s=0.1)
    assert set(report["errors"]) == {"unsupported_image"} and report["errors"]["unsupported_image"] > 0
    assert report["requests"] > 0
    assert "errors {'unsupported_image'" in core.markdown(report)


def test_the_command_reads_the_serve_settings_and_writes_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], _private_model_repository: Path
) -> None:
    monkeypatch.setenv("AI_SERVICE_MODEL__REPOSITORY", str(_private_model_repository))
    monkeypatch.setenv("AI_SERVICE_MODEL__WARMUP", "false")
    monkeypatch.setenv("AI_SERVICE_BATCHING__NORMAL__MAX_BATCH", "2")
    out = tmp_path / "core.json"
    args = ["--images", str(SAMPLES_DIR), "--concurrency", "2", "--seconds", "0.3", "--warmup", "0.1"]
    assert core.main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "digits" and report["requests"] > 0 and report["mean_batch_size"] <= 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == report
    assert "service with no HTTP (2 clients in process)" in captured.err


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--seconds", "0"], ["--warmup", "-1"]])
def test_out_of_bounds_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        core.main(["--images", str(SAMPLES_DIR), *bad])
    assert exit_info.value.code == 2


class _BrokenService:
    """A service whose predictions fail with a bug (not a ``ServiceError``)."""

    settings = SimpleNamespace(server=SimpleNamespace(default_timeout_ms=30_000))

    def served(self, name: str | None) -> object:
        return object()

    def reserve(self, served: object, lane: object, timeout_s: float) -> _BrokenService:
        return self

    def release(self) -> None:
        pass

    async def predict(self, *args: object) -> object:
        raise KeyError("a bug")


async def test_a_client_failing_with_a_bug_fails_the_measurement_instead_of_slowing_it() -> None:
    service: Any = _BrokenService()
    with pytest.raises(RuntimeError, match="a client of the service failed") as failure:
        await core.drive(service, ["aGk="], concurrency=2, seconds=0.05, warmup_s=0.0)
    assert isinstance(failure.value.__cause__, KeyError)
