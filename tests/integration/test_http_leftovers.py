"""HTTP answers a review found missing, under the real uvicorn on loopback: a 505 for an HTTP
version other than 1.x, a 408's echo of an X-Request-ID sent on the last whole header line,
a 415's ``Accept-Encoding`` for a content coding not taken, and the method and path in the
access line of a request whose head was refused.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re

import pytest

from app import connection
from app.bench.rawhttp import build_request, read_response
from app.telemetry.logging import RequestIdFilter
from tests.conftest import SettingsFactory
from tests.integration.test_edge import Served, predict, served
from tests.integration.test_http_framing import answers_then_close
from tests.support import sample_png

FRESH_ID = re.compile(r"[0-9a-f]{32}")


async def _answer_after_silence(running: Served, head: bytes) -> tuple[object, bytes]:
    """Send ``head`` (a head cut short) and wait: the one answer, then the close."""
    ((answer, body),) = await answers_then_close(running, head, 1)
    return answer, body


@pytest.mark.parametrize(
    "request_line",
    ["GET /livez HTTP/2.0", "GET /livez HTTP/3.0", "GET /livez HTTP/0.9", "POST /predict HTTP/2.0"],
    ids=["2.0", "3.0", "0.9", "2.0-with-body"],
)
async def test_an_http_version_other_than_1_x_is_a_505_and_the_connection_closes(
    make_settings: SettingsFactory, request_line: str
) -> None:
    """RFC 9110, 15.6.6: HTTP/2.0 was served as if 1.1, and 3.0 was a 400 ``invalid_http``."""
    body = sample_png(3)
    head = f"{request_line}\r\nHost: x\r\nX-Request-ID: other-version\r\nContent-Length: {len(body)}\r\n\r\n"
    async with served(make_settings()) as running:
        ((answer, sent),) = await answers_then_close(running, head.encode() + body, 1)
        assert running.reached == [], "not served"
    envelope = json.loads(sent)
    assert answer.status == 505 and answer.headers["connection"] == "close"  # type: ignore[attr-defined]
    assert answer.headers["content-type"] == "application/json"  # type: ignore[attr-defined]
    assert envelope["code"] == "http_version_not_supported"
    assert envelope["request_id"] == answer.headers["x-request-id"] == "other-version"  # type: ignore[attr-defined]
    assert request_line.rsplit("/", 1)[1] in envelope["message"]


async def test_the_http_2_connection_preface_is_a_505(make_settings: SettingsFactory) -> None:
    """``curl --http2-prior-knowledge`` opens with it: llhttp stops there (it was a 400)."""
    async with served(make_settings()) as running:
        ((answer, sent),) = await answers_then_close(running, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 1)
    assert answer.status == 505 and json.loads(sent)["code"] == "http_version_not_supported"  # type: ignore[attr-defined]


async def test_a_later_http_1_minor_version_is_served_as_1_1(make_settings: SettingsFactory) -> None:
    """RFC 9110, 2.5: a 1.x above the 1.1 served is read as 1.1 (llhttp failed it as not HTTP: a
    400), Host required as of 1.1, and the connection kept open."""
    async with served(make_settings()) as running:
        reader, writer = await running.connect()
        try:
            writer.write(b"GET /livez HTTP/1.2\r\nHost: x\r\n\r\n" + build_request("GET", "x", "/livez", {}))
            first, _ = await asyncio.wait_for(read_response(reader), 10)
            second, _ = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()
        ((hostless, sent),) = await answers_then_close(running, b"GET /livez HTTP/1.2\r\n\r\n", 1)
    assert (first.status, first.keep_alive, second.status) == (200, True, 200)
    assert hostless.status == 400 and "Host" in json.loads(sent)["message"]  # type: ignore[attr-defined]


async def test_a_408_echoes_an_id_sent_on_the_last_whole_header_line(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httptools hands a header over only when the next begins: the id on the last line before
    the client stalled was lost, and the 408 carried a fresh one. A line not whole is no header."""
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", 0.3)
    async with served(make_settings()) as running:
        last, last_body = await _answer_after_silence(
            running, b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: slow-last\r\n"
        )
        cut, cut_body = await _answer_after_silence(
            running, b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: slow-cut"
        )
        bad, _ = await _answer_after_silence(running, b"POST /predict HTTP/1.1\r\nHost: x\r\nX-Request-ID: a b\r\n")
        assert running.reached == []
    assert last.status == 408 and json.loads(last_body)["code"] == "request_timeout"  # type: ignore[attr-defined]
    assert json.loads(last_body)["request_id"] == last.headers["x-request-id"] == "slow-last"  # type: ignore[attr-defined]
    assert cut.status == 408 and FRESH_ID.fullmatch(cut.headers["x-request-id"])  # type: ignore[attr-defined]
    assert json.loads(cut_body)["request_id"] == cut.headers["x-request-id"]  # type: ignore[attr-defined]
    assert FRESH_ID.fullmatch(bad.headers["x-request-id"]), "an id that is not valid is not echoed"  # type: ignore[attr-defined]


async def test_a_415_for_a_content_encoding_names_the_coding_taken(make_settings: SettingsFactory) -> None:
    """RFC 7694, 3: ``Accept-Encoding`` says what a body may be sent in. A Transfer-Encoding's
    415 has none (no content coding is at fault), nor a Content-Type's."""
    png = sample_png(3)
    coded = gzip.compress(png)
    chunked = f"{len(coded):x}\r\n".encode() + coded + b"\r\n0\r\n\r\n"
    transfer_coded = predict().split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    async with served(make_settings()) as running:
        ((encoded, body),) = await running.exchange(predict(body=coded, Content_Encoding="gzip"))
        ((transferred, _),) = await running.exchange(
            transfer_coded + b"\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + chunked
        )
        ((typed, _),) = await running.exchange(predict(content_type="text/plain"))
    assert encoded.status == 415 and json.loads(body)["code"] == "unsupported_media_type"
    assert encoded.headers["accept-encoding"] == "identity"
    assert transferred.status == 415 and "accept-encoding" not in transferred.headers
    assert typed.status == 415 and "accept-encoding" not in typed.headers


async def test_a_refused_heads_access_line_names_its_method_and_path_when_its_request_line_came(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It said ``- -`` for every refused head; the path without its query, as every access line."""
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", 0.3)
    caplog.handler.addFilter(RequestIdFilter())
    heads = [
        b"GET /livez?token=secret HTTP/1.1\r\n\r\n",  # no Host: 400
        b"GET /v1/models/a%20b/predict HTTP/2.0\r\nHost: x\r\n\r\n",  # 505
        b"POST /predict?token=secret HTTP/1.1\r\n",  # the request line, then nothing: 408
        b"GET /livez HTTP/1.1\r\nHo",  # the request line and a header begun: 408
        b"POST /pred",  # the request line cut short: 408
        b"NOT A REQUEST\r\n\r\n",  # no request line at all: 400
    ]
    async with served(make_settings(logging={"access_log": True})) as running:
        with caplog.at_level(logging.INFO, logger="app.access"):
            statuses = [(await _answer_after_silence(running, head))[0].status for head in heads]  # type: ignore[attr-defined]
    assert statuses == [400, 505, 408, 408, 408, 400]
    access = [r for r in caplog.records if r.name == "app.access"]
    lines = [(r.method, r.path, r.status) for r in access]  # type: ignore[attr-defined]
    assert lines == [
        ("GET", "/livez", 400),
        ("GET", "/v1/models/a b/predict", 505),
        ("POST", "/predict", 408),
        ("GET", "/livez", 408),
        ("-", "-", 408),
        ("-", "-", 400),
    ]
    assert "secret" not in caplog.text
