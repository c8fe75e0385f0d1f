"""uvicorn's lines for what its shutdown cuts off, told as the documented outcomes they are."""

from __future__ import annotations

import asyncio
import logging

from app.server import SHUTDOWN_CUT, shutdown_cuts_told


def _record(message: str, args: tuple[object, ...] = (), exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, args, exc_info)


def test_the_cancel_of_requests_still_running_is_a_warning_and_of_none_a_note() -> None:
    for cut, level in ((3, logging.WARNING), (0, logging.INFO)):
        record = _record("Cancel %s running task(s), timeout graceful shutdown exceeded", (cut,))
        assert shutdown_cuts_told(record)
        assert (record.levelno, record.levelname) == (level, logging.getLevelName(level))
        said = f"shutdown: the wait for open connections ended: {cut} request(s) still running cut off"
        assert record.getMessage() == said


def test_an_answer_cut_by_the_shutdown_loses_its_traceback_and_other_errors_keep_theirs() -> None:
    cut = _record("Exception in ASGI application\n", exc=asyncio.CancelledError(SHUTDOWN_CUT))
    assert shutdown_cuts_told(cut) and cut.levelno == logging.WARNING and cut.exc_info is None
    assert cut.getMessage() == "shutdown: an answer its client was not reading was cut off"
    for other in (asyncio.CancelledError("something else"), ValueError(SHUTDOWN_CUT)):
        record = _record("Exception in ASGI application\n", exc=other)
        assert shutdown_cuts_told(record) and record.levelno == logging.ERROR and record.exc_info is not None
