"""Settings: defaults from config/, environment overrides, and refusals that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import SettingsError, load_settings


def test_the_shipped_config_gives_the_design_card_defaults() -> None:
    settings = load_settings()
    assert settings.batching.normal.window_ms == 25.0
    assert settings.batching.normal.max_batch == 16
    assert settings.batching.urgent.window_ms == 2.0
    assert settings.model.default == "digits"
    assert settings.server.max_image_bytes == 1 << 20


def test_environment_overrides_nested_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_SERVICE_BATCHING__NORMAL__WINDOW_MS", "10")
    monkeypatch.setenv("AI_SERVICE_MODEL__NAMES", '["digits"]')
    settings = load_settings()
    assert settings.batching.normal.window_ms == 10.0
    assert settings.model.names == ["digits"]


def test_another_config_file_can_be_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "service.toml"
    config.write_text("[batching.normal]\nwindow_ms = 5.0\nmax_batch = 4\nmax_queue = 8\n")
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    settings = load_settings()
    assert (settings.batching.normal.window_ms, settings.batching.normal.max_batch) == (5.0, 4)
    assert settings.model.default is None, "the shipped file is replaced, not merged"


def test_a_missing_config_file_named_explicitly_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(tmp_path / "nope.toml"))
    with pytest.raises(SettingsError, match="nope.toml"):
        load_settings()


@pytest.mark.parametrize(
    ("variable", "value", "named", "rule"),
    [
        (
            "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS",
            "0",
            "AI_SERVICE_BATCHING__NORMAL__WINDOW_MS",
            "greater than or equal to 0.001",
        ),
        (
            "AI_SERVICE_BATCHING__URGENT__WINDOW_MS",
            "5e-324",
            "AI_SERVICE_BATCHING__URGENT__WINDOW_MS",
            "greater than or equal",
        ),
        ("AI_SERVICE_SERVER__API_KEY", "", "AI_SERVICE_SERVER__API_KEY", "at least 16 characters"),
        ("AI_SERVICE_SERVER__API_KEY", "short-key", "AI_SERVICE_SERVER__API_KEY", "at least 16 characters"),
        (
            "AI_SERVICE_BATCHING__URGENT__MAX_BATCH",
            "0",
            "AI_SERVICE_BATCHING__URGENT__MAX_BATCH",
            "greater than or equal",
        ),
        (
            "AI_SERVICE_BATCHING__NORMAL__MAX_QUEUE",
            "4",
            "AI_SERVICE_BATCHING__NORMAL",
            "max_queue must be >= max_batch",
        ),
        ("AI_SERVICE_BATCHING__URGENT__WINDOW_MS", "50", "AI_SERVICE_BATCHING", "urgent.window_ms must be <="),
        ("AI_SERVICE_MODEL__DEVICE", "tpu", "AI_SERVICE_MODEL__DEVICE", "pattern"),
        ("AI_SERVICE_MODEL__LOAD_TIMEOUT_S", "-1", "AI_SERVICE_MODEL__LOAD_TIMEOUT_S", "greater than 0"),
        ("AI_SERVICE_SERVER__DEFAULT_TIMEOUT_MS", "200000", "AI_SERVICE_SERVER", "default_timeout_ms must be <="),
        ("AI_SERVICE_SERVER__PORT", "http", "AI_SERVICE_SERVER__PORT", "valid integer"),
    ],
)
def test_a_bad_value_is_refused_naming_the_setting_and_the_rule(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str, rule: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert named in str(caught.value)
    assert rule in str(caught.value)


@pytest.mark.parametrize(
    ("value", "fill"), [("true", "always"), ("False", "never"), ("backlog", "backlog"), ("never", "never")]
)
def test_urgent_fill_takes_a_mode_or_a_boolean(monkeypatch: pytest.MonkeyPatch, value: str, fill: str) -> None:
    monkeypatch.setenv("AI_SERVICE_BATCHING__URGENT_FILL", value)
    assert load_settings().batching.urgent_fill == fill


def test_an_unknown_setting_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "typo.toml"
    config.write_text("[batching.normal]\nwindow_msec = 5.0\n")
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    with pytest.raises(SettingsError, match="window_msec"):
        load_settings()
