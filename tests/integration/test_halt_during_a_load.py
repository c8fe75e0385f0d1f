"""A service halted (a second signal, Ctrl-C) while an admin load runs does not wait for the load.

The lifespan's close waited for every admin load under way (bounded only by
``model.load_timeout_s``), and the close then joined the loader thread for 10 s: a second signal,
meant to stop at once, held the exit for as long as the load took.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest

from app.inference.loader import LayeredModel
from tests.integration.test_lifecycle_api import AUTH, add_version, settings_for
from tests.support import running_app

HELD_S = 60.0  # the load's hold: longer than any close may wait


async def test_a_halt_does_not_wait_for_an_admin_load_under_way(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, release, left = threading.Event(), threading.Event(), threading.Event()
    load = LayeredModel.load.__func__  # type: ignore[attr-defined]

    def held(cls: type[LayeredModel], folder: Path, *args: Any) -> LayeredModel:
        if folder.name == "3":  # the admin load's version: held on the loader thread
            inside.set()
            release.wait(HELD_S)
            left.set()
        result: LayeredModel = load(cls, folder, *args)
        return result

    monkeypatch.setattr(LayeredModel, "load", classmethod(held))
    loading: asyncio.Future[Any] | None = None
    try:
        async with running_app(settings_for(repository, load_timeout_s=600)) as running:
            add_version(repository, "3")
            loading = asyncio.ensure_future(running.client.post("/admin/models/digits/versions/3/load", headers=AUTH))
            assert await asyncio.to_thread(inside.wait, 30), "the load never reached the loader thread"
            running.service.halt()
        # the lifespan's close has ended: the load must still be held then
        still_loading = not left.is_set()
        service = running.service
    finally:
        release.set()
        if loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(loading, 30)
    assert still_loading, "the close waited for the load after the halt"
    assert "loader" in service.unfinished, "the loader thread, still inside the load, is named"
