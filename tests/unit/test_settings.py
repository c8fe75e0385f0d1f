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
    assert settings.model.default is None  # the first model by name: the bundled repository's digits, or any other
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
        (
            "AI_SERVICE_BATCHING__URGENT_FILL_BACKLOG",
            "0",
            "AI_SERVICE_BATCHING__URGENT_FILL_BACKLOG",
            "greater than or equal",
        ),
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
    ("variable", "value", "named"),
    [
        ("AI_SERVICE_MODEL__VERSIONS", '{"digits": [1]}', "model.versions.digits.0 (AI_SERVICE_MODEL__VERSIONS)"),
        (
            "AI_SERVICE_MODEL__DEFAULT_VERSIONS",
            '{"digits": 2}',
            "model.default_versions.digits (AI_SERVICE_MODEL__DEFAULT_VERSIONS)",
        ),
        ("AI_SERVICE_MODEL__CANARY", '{"digits": {"2": "half"}}', "model.canary.digits.2 (AI_SERVICE_MODEL__CANARY)"),
        ("AI_SERVICE_MODEL__NAMES", "[1]", "model.names.0 (AI_SERVICE_MODEL__NAMES)"),
        ("AI_SERVICE_SERVER__PROT", "9", "server.prot (AI_SERVICE_SERVER__PROT)"),  # unknown: named as set
    ],
)
def test_a_bad_entry_of_a_list_or_table_names_the_variable_that_holds_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    """The entry's keys are inside the variable's JSON: ``AI_SERVICE_MODEL__VERSIONS__DIGITS__0``,
    which the message named before, is no variable a user can set."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        # read in any case, named as spelled (they were blamed on the config file)
        ("ai_service_server__prot", "1", "server.prot (ai_service_server__prot)"),
        ("ai_service_batching__normal__max_batch", "0", "(ai_service_batching__normal__max_batch): "),
        # a rule over a group's settings, or across groups: the variables set under it (it named the
        # group's own variable, which nobody sets, or nothing at all)
        ("AI_SERVICE_SERVER__DEFAULT_TOP_K", "30", "server (AI_SERVICE_SERVER__DEFAULT_TOP_K): "),
        ("AI_SERVICE_BATCHING__NORMAL__WINDOW_MS", "25000", "settings (AI_SERVICE_BATCHING__NORMAL__WINDOW_MS): "),
        # a name the group does not have, one level too deep: the variable as given
        ("AI_SERVICE_BATCHING__NORMAL__WINDOW__MS", "5", "(AI_SERVICE_BATCHING__NORMAL__WINDOW__MS): "),
    ],
)
def test_a_refused_setting_names_the_variable_as_it_was_set(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert named in str(caught.value)


def test_a_json_variable_in_lower_case_that_does_not_parse_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ai_service_model__names", "digits")
    with pytest.raises(SettingsError, match=r"^ai_service_model__names cannot be read"):
        load_settings()


@pytest.mark.parametrize(
    ("value", "fill"), [("true", "always"), ("False", "never"), ("backlog", "backlog"), ("never", "never")]
)
def test_urgent_fill_takes_a_mode_or_a_boolean(monkeypatch: pytest.MonkeyPatch, value: str, fill: str) -> None:
    monkeypatch.setenv("AI_SERVICE_BATCHING__URGENT_FILL", value)
    assert load_settings().batching.urgent_fill == fill


def test_a_bad_value_in_the_config_file_is_named_with_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was named by its variable alone (``AI_SERVICE_SERVER__PORT``), which nobody had set."""
    config = tmp_path / "bad.toml"
    config.write_text('[server]\nport = "http"\n\n[batching.normal]\nwindow_msec = 5.0\n')
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert f"server.port (config file {config})" in str(caught.value)
    assert f"batching.normal.window_msec (config file {config})" in str(caught.value)
    monkeypatch.setenv("AI_SERVICE_SERVER__PORT", "http")  # the variable has the last word: it is named
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "server.port (AI_SERVICE_SERVER__PORT)" in str(caught.value)


def test_an_unknown_setting_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "typo.toml"
    config.write_text("[batching.normal]\nwindow_msec = 5.0\n")
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    with pytest.raises(SettingsError, match="window_msec"):
        load_settings()


def test_one_lane_field_keeps_the_others_defaults_whatever_file_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "service.toml"
    config.write_text("[batching.urgent]\nwindow_ms = 1.0\n")  # a file that does not repeat the lanes
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    monkeypatch.setenv("AI_SERVICE_BATCHING__NORMAL__WINDOW_MS", "10")
    batching = load_settings().batching
    assert (batching.normal.window_ms, batching.normal.max_batch, batching.normal.max_queue) == (10.0, 16, 1024)
    assert (batching.urgent.window_ms, batching.urgent.max_batch, batching.urgent.max_queue) == (1.0, 16, 256)


def test_an_environment_value_that_does_not_parse_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AI_SERVICE_MODEL__NAMES", "digits")  # a list must be JSON
    with pytest.raises(SettingsError) as refused:
        load_settings()
    assert "AI_SERVICE_" in str(refused.value) and "JSON" in str(refused.value)
    assert "config file" not in str(refused.value), "not the file's fault"


@pytest.mark.parametrize(
    "variable",
    [
        "AI_SERVICE_SERVER__SHUTDOWN_GRACE_S",
        "AI_SERVICE_MODEL__LOAD_TIMEOUT_S",
        "AI_SERVICE_TELEMETRY__SCHEDULE_DELAY_MS",
        "AI_SERVICE_ADMIN__CONFIG_WATCH_S",
    ],
)
@pytest.mark.parametrize("value", ["inf", "nan", "1e300"])
def test_times_that_would_overflow_where_they_are_waited_on_are_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as refused:
        load_settings()
    assert variable in str(refused.value)


def test_a_token_file_that_cannot_be_used_names_its_setting(tmp_path: Path) -> None:
    from app.settings import read_secrets

    short = tmp_path / "token"
    short.write_text("too-short\n")
    for file, why in ((tmp_path / "missing", "cannot be read"), (short, "fewer than 16")):
        settings = load_settings(admin={"enabled": True, "token_file": file})
        with pytest.raises(SettingsError) as refused:
            read_secrets(settings)
        assert "admin.token_file (AI_SERVICE_ADMIN__TOKEN_FILE)" in str(refused.value) and why in str(refused.value)
    assert read_secrets(load_settings(admin={"enabled": False, "token_file": tmp_path / "missing"})) == (None, None)


@pytest.mark.parametrize(
    ("group", "inline", "file"), [("admin", "token", "token_file"), ("server", "api_key", "api_key_file")]
)
def test_a_secret_given_both_inline_and_as_a_file_is_refused(
    tmp_path: Path, group: str, inline: str, file: str
) -> None:
    """The inline secret won and the file was never read: rotating the file (a Kubernetes Secret)
    left the old secret in use and refused the new one, without a word."""
    secret = tmp_path / "secret"
    secret.write_text("from-the-file-0123456789\n")
    values: dict[str, object] = {inline: "inline-secret-0123456789", file: secret}
    if group == "admin":
        values["enabled"] = True
    with pytest.raises(SettingsError, match=f"{group}.{inline} and {group}.{file} are both set"):
        load_settings(**{group: values})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AI_SERVICE_MODEL__NAMES", "digits"),  # a list, written as a plain word
        ("AI_SERVICE_MODEL__VERSIONS", "digits=1"),  # a table
        ("AI_SERVICE_BATCHING__NORMAL", "window_ms=5"),  # a whole group
    ],
)
def test_a_list_or_table_variable_that_is_not_json_is_named(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AI_SERVICE_SERVER__PORT", "9000")  # a readable one beside it is not named
    with pytest.raises(SettingsError, match=rf"^{variable} cannot be read: lists and tables are JSON"):
        load_settings()


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[batching.normal]\nmax_batch = true\n", "batching.normal.max_batch"),
        ("[batching.urgent]\nwindow_ms = false\n", "batching.urgent.window_ms"),
        ("[server]\nport = true\n", "server.port"),
    ],
)
def test_a_boolean_where_a_number_goes_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toml: str, named: str
) -> None:
    """TOML's ``true`` is not a batch of 1 (lax validation took it so; the admin API refused it)."""
    config = tmp_path / "service.toml"
    config.write_text(toml)
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", str(config))
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert named in str(caught.value) and "not true or false" in str(caught.value)


@pytest.mark.parametrize(
    "group",
    [{"model": {"urgent_workers": True}}, {"model": {"canary": {"digits": {"2": True}}}}],
)
def test_a_boolean_is_no_number_in_an_optional_number_or_a_table_of_them(group: dict[str, object]) -> None:
    with pytest.raises(SettingsError, match="not true or false"):
        load_settings(**group)


@pytest.mark.parametrize("around", [("", "\n"), ("  ", " \r\n"), ("\t", "")])
def test_a_secret_from_the_environment_loses_the_whitespace_around_it_as_one_from_a_file_does(
    monkeypatch: pytest.MonkeyPatch, around: tuple[str, str]
) -> None:
    """``AI_SERVICE_ADMIN__TOKEN=$(cat token)`` keeps no newline, but a secret mounted as a
    variable often does: it passed start-up and no header could carry it (every request 403)."""
    from app.settings import read_secrets

    before, after = around
    token, key = "admin-token-0123456789", "api-key-0123456789"
    monkeypatch.setenv("AI_SERVICE_ADMIN__ENABLED", "true")
    monkeypatch.setenv("AI_SERVICE_ADMIN__TOKEN", before + token + after)
    monkeypatch.setenv("AI_SERVICE_SERVER__API_KEY", before + key + after)
    settings = load_settings()
    assert read_secrets(settings) == (token.encode(), key.encode())
    assert settings.admin.token is not None and settings.admin.token.get_secret_value() == token


@pytest.mark.parametrize("variable", ["AI_SERVICE_ADMIN__TOKEN", "AI_SERVICE_SERVER__API_KEY"])
def test_whitespace_around_a_secret_does_not_count_towards_its_16_characters(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv("AI_SERVICE_ADMIN__ENABLED", "true")
    monkeypatch.setenv("AI_SERVICE_ADMIN__TOKEN", "admin-token-0123456789")
    monkeypatch.setenv(variable, "   short-secret \n")  # 18 characters, 12 of them the secret
    with pytest.raises(SettingsError, match="at least 16 characters"):
        load_settings()


@pytest.mark.parametrize("value", ["0.0001", "0.05", "0.099"])
def test_a_config_poll_more_often_than_every_tenth_of_a_second_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A poll stats and hashes the file: every 0.1 ms it kept most of a core busy while idle."""
    monkeypatch.setenv("AI_SERVICE_ADMIN__CONFIG_WATCH_S", value)
    with pytest.raises(SettingsError) as refused:
        load_settings()
    assert "AI_SERVICE_ADMIN__CONFIG_WATCH_S" in str(refused.value)
    assert "0 (off) or at least 0.1" in str(refused.value)


@pytest.mark.parametrize(("value", "seconds"), [("0", 0.0), ("0.1", 0.1), ("2", 2.0)])
def test_the_config_poll_may_be_off_or_a_tenth_of_a_second_and_more(
    monkeypatch: pytest.MonkeyPatch, value: str, seconds: float
) -> None:
    monkeypatch.setenv("AI_SERVICE_ADMIN__CONFIG_WATCH_S", value)
    assert load_settings().admin.config_watch_s == seconds


@pytest.mark.parametrize(
    ("exporter", "endpoint", "valid"),
    [
        ("otlp_grpc", "http://127.0.0.1:4317", True),
        ("otlp_http", "https://collector.example:4318/", True),
        ("otlp_grpc", "collector:4317", True),  # gRPC's exporter takes HOST:PORT
        ("otlp_http", "collector:4318", False),  # HTTP's does not: every export would fail
        ("otlp_http", "::bad", False),
        ("otlp_grpc", "http://127.0.0.1:notaport", False),
        ("otlp_grpc", "http://:4317", False),
        ("otlp_http", "http://collector:99999", False),
    ],
)
def test_an_otlp_endpoint_that_cannot_be_reached_is_refused_at_start(exporter: str, endpoint: str, valid: bool) -> None:
    """It started, and every span was dropped, the reason only in the export's failures."""
    given = {"exporter": exporter, "endpoint": endpoint}
    if valid:
        assert load_settings(telemetry=given).telemetry.endpoint == endpoint
    else:
        with pytest.raises(SettingsError, match="telemetry.endpoint must be http"):
            load_settings(telemetry=given)


@pytest.mark.parametrize(("value", "said"), [("", "is set but empty"), (".", "a directory, not a file")])
def test_a_config_file_variable_that_names_no_file_says_why(
    monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    """Empty (a compose file's unset variable), it was read as the working directory and said
    ``AI_SERVICE_CONFIG_FILE=.: no such file``; a directory was "no such file" too."""
    monkeypatch.setenv("AI_SERVICE_CONFIG_FILE", value)
    with pytest.raises(SettingsError, match=f"^AI_SERVICE_CONFIG_FILE.*{said}"):
        load_settings()
