"""``ai-backend serve``'s own arguments are checked by its parser: exit 2 naming the argument,
not a setting's environment variable that nobody set."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.cli import main


@pytest.mark.parametrize(("port", "why"), [("70000", "0-65535"), ("-1", "0-65535"), ("http", "not a port")])
def test_a_port_out_of_range_is_refused_as_the_argument_it_is(
    port: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--port", port])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port" in err and why in err, err
    assert "AI_SERVICE_SERVER__PORT" not in err


def test_serve_says_which_config_file_it_read_or_that_none_was_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default is relative to the working directory: started elsewhere the service ran on the
    built-in defaults without a word. The file is named absolute, and its absence is a warning."""
    from app.cli import _say_config_file
    from app.settings import file_stamp

    present, absent = tmp_path / "service.toml", tmp_path / "missing.toml"
    present.write_text("[server]\nport = 8000\n")
    with caplog.at_level(logging.INFO, logger="app.cli"):
        _say_config_file(present, file_stamp(present))
        _say_config_file(absent, file_stamp(absent))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.INFO, f"settings read from the config file {present} and the environment"),
        (logging.WARNING, f"no config file at {absent}: the built-in defaults and the environment apply"),
    ]


def test_a_signal_once_the_server_has_stopped_is_not_taken_for_one_before_it_started(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """uvicorn puts back the handlers it found when it stops: start-up's, which end the process as
    "stopped before the server started", exit 0, and skip the exit that does not finalize the
    interpreter under a thread still inside torch. Once the server stopped, SIGTERM and SIGQUIT
    are ignored: the exit is under way."""
    import signal

    import app.cli as cli

    seen: dict[str, object] = {}

    def served(server: object, failure: list[str], address: str, logs: object) -> int:
        seen["during"] = signal.getsignal(signal.SIGTERM)
        return 0

    monkeypatch.setattr(cli, "_run", served)  # the handlers it sets are put back by conftest's _signal_dispositions
    assert cli.main(["serve", "--port", "0"]) == 0
    assert seen["during"] is cli._stop_early, "start-up's handler, until uvicorn's"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN
    assert "before the server started" not in capsys.readouterr().err
