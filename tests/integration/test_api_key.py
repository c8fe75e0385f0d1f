"""The optional API key on prediction routes: off by default, bearer scheme when set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SettingsFactory
from tests.support import running_app, sample_png

KEY = "prediction-key-0123456789abcdef"


async def test_prediction_routes_are_open_by_default(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        assert (await running.predict_png(sample_png(1))).status_code == 200


async def test_an_api_key_guards_prediction_but_not_probes(make_settings: SettingsFactory, tmp_path: Path) -> None:
    secret = tmp_path / "key"
    secret.write_text(KEY)
    async with running_app(make_settings(server={"api_key_file": secret})) as running:
        missing = await running.predict_png(sample_png(1))
        assert missing.status_code == 401 and missing.json()["code"] == "unauthorized"
        wrong = await running.predict_png(sample_png(1), headers={"Authorization": "Bearer " + "x" * 31})
        assert wrong.status_code == 403 and wrong.json()["code"] == "forbidden"
        named = await running.client.post(
            "/v1/models/digits/predict", content=sample_png(1), headers={"Content-Type": "image/png"}
        )
        assert named.status_code == 401
        right = await running.predict_png(sample_png(1), headers={"Authorization": f"Bearer {KEY}"})
        assert right.status_code == 200
        padded = await running.predict_png(sample_png(1), headers={"Authorization": f"Bearer \t{KEY} "})
        assert padded.status_code == 200, "spaces and tabs around the token are the header's, not the token's"
        # a latin-1 no-break space is not white space to the scheme: with str.strip(), "Bearer \xa0"
        # matched an empty key, and a key ending in one matched its stripped form
        nbsp = await running.predict_png(
            sample_png(1), headers={"Authorization": f"Bearer {KEY}\xa0".encode("latin-1")}
        )
        assert nbsp.status_code == 403
        for probe in ("/livez", "/readyz", "/healthz", "/metrics", "/v1/models"):
            assert (await running.client.get(probe)).status_code == 200, probe


async def test_a_401_names_its_scheme(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings(server={"api_key": "k" * 24})) as running:
        missing = await running.predict_png(sample_png(3))
        wrong = await running.predict_png(sample_png(3), headers={"Authorization": "Bearer " + "w" * 24})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"  # RFC 9110, 11.6.1
    assert wrong.status_code == 403 and "www-authenticate" not in wrong.headers


async def test_a_key_file_unreadable_at_start_up_fails_it_rather_than_serving_open(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """``serve`` checks the files before it starts; an app built otherwise (a Ray replica) read
    them first in its lifespan, where a failure was only reported: with no key read, predictions
    were served to anyone and every admin call failed with a 500. Now start-up fails."""
    from app.main import StartupFailed

    secret = tmp_path / "key"
    secret.write_text("short")
    reported: list[str] = []
    settings = make_settings(server={"api_key_file": secret}, admin={"enabled": True, "token": KEY})
    with pytest.raises(StartupFailed, match="fewer than 16 characters"):
        async with running_app(settings, on_fatal=reported.append):
            pytest.fail("served with its API key unread")
    assert len(reported) == 1 and "server.api_key_file" in reported[0]
