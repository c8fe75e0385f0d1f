"""Which versions a pin knows (404 or 503) as admins load, refuse and unload, and a load of a
version that serves but is gone from disk."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from tests.integration.test_lifecycle_api import AUTH, add_version, settings_for
from tests.support import RunningApp, running_app, sample_png, truncate_file


async def _pinned(running: RunningApp, version: str) -> tuple[int, str | None]:
    response = await running.predict_png(sample_png(3), headers={"X-Model-Version": version})
    return response.status_code, response.json().get("code")


async def test_a_version_copied_in_or_refused_stays_a_404_to_a_pin_until_it_loads(repository: Path) -> None:
    """Any admin call replaced the versions a pin knows with the repository's listing: a version
    copied in and never loaded, or one whose load was refused, turned from a 404 into a 503 with
    Retry-After, telling clients to retry what was not served (and, refused, could not be)."""
    async with running_app(settings_for(repository)) as running:
        add_version(repository, "3")
        truncate_file(add_version(repository, "4") / "backbone.safetensors")
        assert await _pinned(running, "3") == (404, "version_not_found")
        again = await running.client.post("/admin/models/digits/versions/2/load", headers=AUTH)  # loaded already
        assert again.status_code == 200, again.text
        assert await _pinned(running, "3") == (404, "version_not_found")
        refused = await running.client.post("/admin/models/digits/versions/4/load", headers=AUTH)
        assert refused.status_code == 409 and refused.json()["code"] == "model_load_failed", refused.text
        assert await _pinned(running, "4") == (404, "version_not_found")
        assert await _pinned(running, "3") == (404, "version_not_found")
        assert (await running.client.get("/v1/models/digits")).json()["versions"] == ["1", "2"]

        loaded = await running.client.post("/admin/models/digits/versions/3/load", headers=AUTH)
        assert loaded.status_code == 200, loaded.text
        assert (await running.client.post("/admin/models/digits/versions/3/unload", headers=AUTH)).status_code == 200
        assert await _pinned(running, "3") == (503, "version_not_loaded")  # loaded once, still on disk
        assert (await running.client.get("/v1/models/digits")).json()["versions"] == ["1", "2", "3"]


async def test_loading_a_version_that_serves_but_left_the_disk_answers_as_for_any_loaded_one(
    repository: Path,
) -> None:
    """The repository was listed before the routing was looked at: a repeated load of a version
    that serves was a 404 once its folder was gone (unload and promote look at the routing first)."""
    async with running_app(settings_for(repository)) as running:
        assert await _pinned(running, "2") == (200, None)  # its head loaded
        await asyncio.to_thread(shutil.rmtree, repository / "digits" / "2")
        again = await running.client.post("/admin/models/digits/versions/2/load", headers=AUTH)
        assert again.status_code == 200 and again.json()["loaded_versions"] == ["1", "2"], again.text
        assert await _pinned(running, "2") == (200, None)
