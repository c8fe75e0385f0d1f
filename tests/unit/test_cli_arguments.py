"""``ai-backend serve``'s own arguments are checked by its parser: exit 2 naming the argument,
not a setting's environment variable that nobody set."""

from __future__ import annotations

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
