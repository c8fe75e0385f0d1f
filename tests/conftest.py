"""Fixtures shared by every test: a hermetic environment, test settings, sample images."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests import support
from tests.support import LABELS, REPO_ROOT, build_settings, copy_repository, sample_png

SettingsFactory = Callable[..., Settings]


@pytest.fixture(scope="session", autouse=True)
def _hermetic_environment() -> Iterator[None]:
    """Tests see the shipped config/default.toml and no AI_SERVICE_* variables from the shell.

    Session-scoped, so that module-scoped apps are built in the same environment.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("AI_SERVICE_"):
                patch.delenv(name)
        patch.chdir(REPO_ROOT)
        yield


# What a test may change process-wide without meaning to: ``main(["serve"])`` sets SIGTERM (and
# SIGQUIT) to end start-up early and ignores SIGHUP (as a fresh process should), and every app's lifespan
# leaves SIGHUP ignored once it takes its reload handler down.
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGQUIT", "SIGHUP", "SIGINT") if hasattr(signal, name))


@pytest.fixture(autouse=True)
def _signal_dispositions() -> Iterator[None]:
    """Each test leaves the signal handlers as it found them: a SIGTERM to pytest (a CI job
    cancelled) ends it, and does not raise a serve command's start-up exception in a later test."""
    before = {number: signal.getsignal(number) for number in _SIGNALS}
    yield
    for number, handler in before.items():
        if signal.getsignal(number) is not handler and handler is not None:
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def _root_logger() -> Iterator[None]:
    """Each test leaves the root logger as it found it. A test that runs the CLI in process has it
    configure the service's logging (``configure_logging``): its handler, on that test's captured
    stderr, stayed for later tests, which wrote to it once closed ("--- Logging error ---"), and
    the root's level stayed INFO, so later tests' captured records held lines they did not expect
    (a scrape's access line). pytest's own capture handlers are left to pytest."""
    from app.telemetry.logging import JsonFormatter, PlainFormatter

    root = logging.getLogger()
    level = root.level
    yield
    root.handlers[:] = [h for h in root.handlers if not isinstance(h.formatter, JsonFormatter | PlainFormatter)]
    root.setLevel(level)


# the longest a test may run: one that waits for a future a broken batcher never settles would
# otherwise hang until CI's own timeout, naming no test (the slowest test here takes under a minute)
TEST_LIMIT_S = 300


@pytest.fixture(autouse=True)
def _bounded(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that runs past ``TEST_LIMIT_S``, naming it: the alarm raises in the main thread,
    in the test's event loop or wherever it waits (pytest-timeout's signal method, in a few lines)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{request.node.nodeid} ran past {TEST_LIMIT_S} s: a wait that never ends?")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture(scope="session", autouse=True)
def _private_model_repository(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """In-process apps serve a session copy of models/ (the e2e tests serve models/ itself)."""
    root = copy_repository(tmp_path_factory.mktemp("repository"))
    support.test_repository = root
    try:
        yield root
    finally:
        support.test_repository = None


@pytest.fixture
def make_settings() -> SettingsFactory:
    """``make_settings(batching={"normal": {...}}, ...)``: test defaults deep-merged with the overrides."""

    def make(**overrides: Any) -> Settings:
        return build_settings(**overrides)

    return make


@pytest.fixture(scope="session")
def sample_pngs() -> dict[str, bytes]:
    """The ten bundled sample PNGs by label ("0".."9")."""
    return {label: sample_png(int(label)) for label in LABELS}


@pytest.fixture
def no_hurry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No request hurries (``app.batching.policy.hurries``): each waits out its lane's window, as
    one does behind a busy device. For the tests of what a deadline does to a request still queued,
    which a short deadline on an idle lane would otherwise send straight to the device."""
    import app.batching.batcher
    import app.batching.intake

    monkeypatch.setattr(app.batching.batcher, "hurries", lambda *_: False)
    monkeypatch.setattr(app.batching.intake, "hurries", lambda *_: False)
