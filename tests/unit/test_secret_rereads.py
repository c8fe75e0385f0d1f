"""SIGHUP, or a change of their files, reads the admin token and the API key from their files
again: each on its own, one re-read at a time."""

from __future__ import annotations

import asyncio
import logging
import threading
import types
from pathlib import Path
from typing import Any

import pytest

import app.main as main_module
from app.settings import read_each_secret
from tests.conftest import SettingsFactory

OLD, NEW = "old-admin-token-0123456789", "new-admin-token-0123456789"
KEY = "api-key-0123456789abcdef"


class _Policy:
    def wake(self) -> None:
        return None


def _app(token: str, key: str | None = None) -> Any:
    return types.SimpleNamespace(
        state=types.SimpleNamespace(admin_token=token.encode(), api_key=key.encode() if key else None)
    )


def _both_in_files(make_settings: SettingsFactory, tmp_path: Path, watch_s: float) -> tuple[Path, Path, Any]:
    """The admin token and the API key in files (OLD and KEY), and settings naming them."""
    token_file, key_file = tmp_path / "token", tmp_path / "key"
    token_file.write_text(OLD)
    key_file.write_text(KEY)
    settings = make_settings(
        admin={"enabled": True, "token_file": str(token_file), "config_watch_s": watch_s},
        server={"api_key_file": str(key_file)},
    )
    return token_file, key_file, settings


async def test_a_read_begun_before_a_rotation_never_lands_after_one_begun_after_it(
    make_settings: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two SIGHUPs around a rotation (a reloader sidecar sends several): the first read, of the
    old file, came back after the second, of the new one, and brought the revoked token back."""
    token_file = tmp_path / "token"
    token_file.write_text(OLD)
    settings = make_settings(admin={"enabled": True, "token_file": str(token_file), "config_watch_s": 0})
    app = _app(OLD)
    reads: list[str] = []
    first_read, rotated = threading.Event(), threading.Event()

    def slow_first(settings: Any) -> Any:  # a slow mount: the first read returns late
        read = read_each_secret(settings)
        reads.append(read[0].decode() if isinstance(read[0], bytes) else "error")
        if len(reads) == 1:
            first_read.set()
            rotated.wait(5)
        return read

    monkeypatch.setattr(main_module, "read_each_secret", slow_first)
    tasks: set[asyncio.Task[None]] = set()
    on_sighup, watch = main_module._reloader(app, settings, _Policy(), tasks)  # type: ignore[arg-type]
    on_sighup()  # before the rotation
    await asyncio.to_thread(first_read.wait, 5)
    token_file.write_text(NEW)  # noqa: ASYNC240 - a few bytes, in a test
    on_sighup()  # after it
    await asyncio.sleep(0.05)  # the second re-read has had its chance to start and read
    rotated.set()
    await asyncio.gather(*tasks, watch)  # (config_watch_s=0: the watch has ended at once)
    assert reads == [OLD, NEW]
    assert app.state.admin_token == NEW.encode(), "the revoked token came back"


async def test_a_file_that_cannot_be_used_keeps_its_secret_and_the_other_rotates(
    make_settings: SettingsFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file, key_file, settings = _both_in_files(make_settings, tmp_path, watch_s=0)
    app = _app(OLD, KEY)
    token_file.write_text(NEW)  # noqa: ASYNC240 - the admin token rotated (a leaked one revoked)
    key_file.write_text("short")  # noqa: ASYNC240 - and the key's file is broken meanwhile
    with caplog.at_level(logging.INFO, logger="app.main"):
        await main_module._reread_secrets(app, settings, asyncio.Lock())
    assert app.state.api_key == KEY.encode(), "an unusable file keeps its secret"
    assert app.state.admin_token == NEW.encode(), "the good rotation was held back by the other file"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "api_key_file" in errors[0] and "short" not in errors[0], errors


async def test_a_rotated_file_is_read_again_with_no_signal(
    make_settings: SettingsFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kubernetes swaps a rotated Secret into its volume and sends no signal, and a Ray replica
    cannot take one (SIGHUP ended it): the files are watched as the config file is."""
    token_file, key_file, settings = _both_in_files(make_settings, tmp_path, watch_s=0.1)
    app = _app(OLD, KEY)
    tasks: set[asyncio.Task[None]] = set()
    _, watch = main_module._reloader(app, settings, _Policy(), tasks)  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.INFO, logger="app.main"):
            await asyncio.sleep(0.05)  # its first look at the files
            renamed = tmp_path / "token.new"
            renamed.write_text(NEW)  # noqa: ASYNC240 - as a Secret's volume swaps it in: a rename
            renamed.replace(token_file)
            async with asyncio.timeout(10):
                while app.state.admin_token != NEW.encode():  # noqa: ASYNC110 (a plain attribute)
                    await asyncio.sleep(0.05)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    assert app.state.api_key == KEY.encode()
    said = [r.getMessage() for r in caplog.records if r.name == "app.main"]
    assert said == [
        "a secret's file changed: the admin token or the API key changed in its file and is in use from now on"
    ]
