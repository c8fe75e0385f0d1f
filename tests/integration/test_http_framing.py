"""Bytes that are not HTTP, and a client's half-close, under the real uvicorn on loopback.

uvicorn answers a parse error with a plain-text 400 at once and closes, even while a request
pipelined before the bad bytes is still being answered: the client took that 400 for its
request's answer. A client's half-close (``shutdown(SHUT_WR)``) stays what it was: the
client leaving (its FIN is the FIN of a closed socket).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from app import connection
from app.batching import Lane
from app.bench.rawhttp import build_request, read_response
from app.telemetry.logging import RequestIdFilter
from app.telemetry.metrics import PREFIX
from tests.conftest import SettingsFactory
from tests.integration.test_edge import Served, predict, served
from tests.support import metric_samples, running_app, sample_png

GARBAGE = b"NOT A REQUEST\r\n\r\n"


async def answers_then_close(running: Served, data: bytes, count: int) -> list[tuple[object, bytes]]:
    """Send ``data`` on a fresh connection; read ``count`` answers, then expect the close."""
    reader, writer = await running.connect()
    try:
        writer.write(data)
        answers = [await asyncio.wait_for(read_response(reader), 10) for _ in range(count)]
        assert await asyncio.wait_for(reader.read(), 10) == b"", "the connection closes after the 400"
        return answers  # type: ignore[return-value]
    finally:
        writer.close()


def is_invalid_http(head: object, body: bytes) -> bool:
    envelope = json.loads(body)
    return (
        head.status == 400  # type: ignore[attr-defined]
        and head.headers["content-type"] == "application/json"  # type: ignore[attr-defined]
        and head.headers["connection"] == "close"  # type: ignore[attr-defined]
        and envelope["code"] == "invalid_http"
        and envelope["request_id"] == head.headers["x-request-id"]  # type: ignore[attr-defined]
    )


async def test_bytes_that_are_not_http_get_a_400_in_the_envelope(make_settings: SettingsFactory) -> None:
    async with served(make_settings()) as running:
        ((head, body),) = await answers_then_close(running, GARBAGE, 1)
        assert running.reached == []
    assert is_invalid_http(head, body)


async def test_a_request_pipelined_before_bad_bytes_keeps_its_answer(make_settings: SettingsFactory) -> None:
    async with served(make_settings()) as running:
        (first, first_body), (second, second_body) = await answers_then_close(
            running, predict(X_Request_ID="first-of-two") + GARBAGE, 2
        )
        assert running.reached == ["POST /predict"]
    assert first.status == 200 and first.headers["x-request-id"] == "first-of-two"  # type: ignore[attr-defined]
    assert json.loads(first_body)["predictions"][0]["label"] == "3"
    assert is_invalid_http(second, second_body)


async def test_a_body_longer_than_its_content_length_answers_the_request_then_the_rest(
    make_settings: SettingsFactory,
) -> None:
    png = sample_png(3)
    request = build_request(
        "POST", "127.0.0.1", "/predict", {"Content-Type": "image/png", "X-Request-ID": "short"}, png
    )
    request = request.replace(f"Content-Length: {len(png)}".encode(), b"Content-Length: 10")
    async with served(make_settings()) as running:
        (first, first_body), (second, second_body) = await answers_then_close(running, request, 2)
    # ten bytes of a PNG are not an image: that request's own answer, then the rest's 400
    assert first.status == 400 and first.headers["x-request-id"] == "short"  # type: ignore[attr-defined]
    assert json.loads(first_body)["code"] in {"undecodable_image", "unsupported_image"}
    assert is_invalid_http(second, second_body)


def _send_half_close_read(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # nothing more to send: the request stream has ended
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


async def test_a_half_close_after_a_request_is_the_client_leaving(make_settings: SettingsFactory) -> None:
    # on the wire, the FIN of shutdown(SHUT_WR) is the FIN of a closed socket, and the closed
    # socket is the common case: the request is cancelled, not computed for nobody
    async with served(make_settings()) as running:
        answer = await asyncio.to_thread(_send_half_close_read, running.port, predict())
    assert answer == b""


def _chunked_predict_head(**headers: str) -> bytes:
    lines = [
        "POST /predict HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: image/png",
        "Transfer-Encoding: chunked",
        *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_an_edge_refused_request_whose_body_breaks_gets_one_answer(make_settings: SettingsFactory) -> None:
    # the edge answers 503 at the headers, then the body breaks (a bad chunk): the request has
    # its answer, so the connection closes without a second one
    async with served(make_settings()) as running:
        ((warm, _),) = await running.exchange(predict())  # a batch timed: predictions refuse now
        assert warm.status == 200
        reader, writer = await running.connect()
        try:
            writer.write(_chunked_predict_head(X_Request_Timeout="1", X_Request_ID="refused-at-edge"))
            head, _ = await asyncio.wait_for(read_response(reader), 10)
            assert head.status == 503 and head.headers["x-request-id"] == "refused-at-edge"
            assert running.reached == ["POST /predict"], "the refusal was the edge's"
            writer.write(b"5\r\nabcde\r\nZZ-not-a-chunk-size\r\n")  # the body breaks
            await writer.drain()
            rest = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
    assert rest == b"", f"one request, a second answer after its 503: {rest[:60]!r}"


async def test_a_body_that_breaks_is_one_400_in_the_answer_its_span_and_its_trace_header(
    make_settings: SettingsFactory,
) -> None:
    """The protocol answers a broken body itself; the app, cut off, answered 499 into the void,
    which its server span recorded while the client, the metrics and the log saw 400; and the
    answer named no trace though the request had one."""
    exporter = InMemorySpanExporter()
    async with served(make_settings(telemetry={"exporter": "console"}), span_exporter=exporter) as running:
        reader, writer = await running.connect()
        try:
            writer.write(_chunked_predict_head(X_Request_ID="broken-body"))
            await writer.drain()
            await asyncio.sleep(0.2)  # its head read and its app task waiting for the body
            writer.write(b"5\r\nabcde\r\nZZ-not-a-chunk-size\r\n")
            head, body = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()
        await asyncio.sleep(0.2)  # the cut-off app task ends, and its server span with it
    assert head.status == 400 and json.loads(body)["code"] == "invalid_http"  # type: ignore[attr-defined]
    (server,) = [
        s
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.SERVER and s.attributes.get("request.id") == "broken-body"
    ]
    assert server.attributes["http.status_code"] == 400
    assert head.headers["x-trace-id"] == format(server.context.trace_id, "032x")  # type: ignore[attr-defined]


async def _metrics_text(running: Served) -> str:
    ((_, body),) = await running.exchange(build_request("GET", "127.0.0.1", "/metrics", {}))
    return body.decode()


async def test_an_invalid_http_answer_is_counted_and_logged_once(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    async with served(make_settings(logging={"access_log": True})) as running:
        with caplog.at_level(logging.INFO, logger="app.access"):
            ((head, body),) = await answers_then_close(running, GARBAGE, 1)
            # a request the app is reading when its chunked body breaks: the 400 is its answer
            reader, writer = await running.connect()
            try:
                writer.write(_chunked_predict_head(X_Request_ID="broken-body") + b"5\r\nabcde\r\nZZ\r\n")
                broken, broken_body = await asyncio.wait_for(read_response(reader), 10)
                assert await asyncio.wait_for(reader.read(), 10) == b""
            finally:
                writer.close()
            text = await _metrics_text(running)
    assert is_invalid_http(head, body) and is_invalid_http(broken, broken_body)
    requests_total = metric_samples(text, f"{PREFIX}_requests_total")
    assert requests_total[(("code", "invalid_http"), ("status", "400"))] == 2
    latency = metric_samples(text, f"{PREFIX}_request_duration_seconds_count")
    assert latency[(("lane", "none"), ("route", "unmatched"), ("status", "400"))] == 1  # not a request at all
    assert sum(v for k, v in latency.items() if ("status", "400") in k) == 2
    cancelled = metric_samples(text, f"{PREFIX}_cancellations_total").get((("reason", "cancelled"),), 0)
    assert cancelled == 0, "a body that broke is not a client that went"
    assert broken.headers["x-request-id"] == "broken-body", "the client's id, as any answer to its request"  # type: ignore[attr-defined]
    # one access line each: the request cut off by its 400 is not also logged as a client leaving (499)
    access = [r for r in caplog.records if r.name == "app.access"]
    lines = [(r.method, r.path, r.status, getattr(r, "code", None), r.request_id) for r in access]  # type: ignore[attr-defined]
    assert lines[:2] == [
        ("-", "-", 400, "invalid_http", head.headers["x-request-id"]),  # type: ignore[attr-defined]
        ("POST", "/predict", 400, "invalid_http", "broken-body"),
    ]


UPGRADE = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"}


def _upgrade_predict(body: bytes, request_id: str) -> bytes:
    headers = {"Content-Type": "image/png", "X-Request-ID": request_id, **UPGRADE}
    return build_request("POST", "127.0.0.1", "/predict", headers, body)


async def test_an_upgrade_to_http2_is_ignored_and_the_request_served_with_its_body(
    make_settings: SettingsFactory,
) -> None:
    # what curl --http2 sends over plain http: httptools ends such a request at its headers, so
    # its body was lost (400 empty_body) and what followed it was never read
    livez = build_request("GET", "127.0.0.1", "/livez", {"X-Request-ID": "behind"})
    async with served(make_settings()) as running:
        (first, body), (second, _) = await running.exchange(_upgrade_predict(sample_png(3), "upgrade"), livez)
        # the body in a later write than the headers
        reader, writer = await running.connect()
        try:
            head, rest = _upgrade_predict(sample_png(4), "late").split(b"\r\n\r\n", 1)
            writer.write(head + b"\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(rest)
            late, late_body = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()
    assert (first.status, first.headers["x-request-id"]) == (200, "upgrade")  # type: ignore[attr-defined]
    assert json.loads(body)["predictions"][0]["label"] == "3"
    assert (second.status, second.headers["x-request-id"]) == (200, "behind")  # type: ignore[attr-defined]
    assert late.status == 200 and json.loads(late_body)["predictions"][0]["label"] == "4"  # type: ignore[attr-defined]


async def test_the_body_of_an_upgrade_request_is_never_read_as_a_request(make_settings: SettingsFactory) -> None:
    inner = build_request("GET", "127.0.0.1", "/livez", {"X-Request-ID": "smuggled"})
    after = build_request("GET", "127.0.0.1", "/livez", {"X-Request-ID": "after"})
    async with served(make_settings()) as running:
        (outer, _), (next_one, _) = await running.exchange(_upgrade_predict(inner, "outer"), after)
    assert (outer.status, outer.headers["x-request-id"]) == (400, "outer")  # type: ignore[attr-defined]  # not an image
    assert (next_one.status, next_one.headers["x-request-id"]) == (200, "after")  # type: ignore[attr-defined]


async def test_a_chunked_upgrade_request_gets_one_400_of_its_own_and_the_connection_closes(
    make_settings: SettingsFactory,
) -> None:
    """Its body's end cannot be told from what follows it: the request is answered 400
    ``invalid_http`` under its own id, once (the app also ran it with an empty body, and
    answered a 400 of its own before the protocol's)."""
    headers = {"Content-Type": "image/png", "X-Request-ID": "chunked-upgrade", "Transfer-Encoding": "chunked"}
    headers |= UPGRADE
    head = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
        f"{name}: {value}\r\n".encode() for name, value in headers.items()
    )
    head += b"\r\n"
    png = sample_png(3)
    async with served(make_settings()) as running:
        for request in (head, head + b"%x\r\n" % len(png) + png + b"\r\n0\r\n\r\n"):
            ((answer, body),) = await answers_then_close(running, request, 1)
            assert is_invalid_http(answer, body)
            assert answer.headers["x-request-id"] == "chunked-upgrade"  # type: ignore[attr-defined]


async def test_bytes_that_are_not_http_after_a_request_answered_before_its_body_get_their_400(
    make_settings: SettingsFactory,
) -> None:
    # a 415 is answered at the headers; its body arrives after the answer, then bytes that are not HTTP
    head, body = predict(content_type="text/plain", X_Request_ID="refused").split(b"\r\n\r\n", 1)
    async with served(make_settings()) as running:
        reader, writer = await running.connect()
        try:
            writer.write(head + b"\r\n\r\n")
            first, _ = await asyncio.wait_for(read_response(reader), 10)
            writer.write(body + GARBAGE)
            second, second_body = await asyncio.wait_for(read_response(reader), 10)
            assert await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()
    assert (first.status, first.headers["x-request-id"]) == (415, "refused")  # type: ignore[attr-defined]
    assert is_invalid_http(second, second_body)


async def test_a_request_answered_before_its_body_whose_body_never_comes_is_closed_after_a_bound(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 413 on the declared length comes at once; the client then sends a little and waits
    (as one that asked ``Expect: 100-continue`` may): the connection closes after the bound, not
    never. A body that does come is read and dropped, and the connection serves on."""
    monkeypatch.setattr(connection, "ANSWERED_BODY_S", 0.2)
    head = predict().split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    head += b"\r\nContent-Length: 2000000\r\n\r\n"
    upgrade = head.replace(b"\r\n\r\n", b"\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")  # its body read apart
    async with served(make_settings()) as running:
        for request in (head, upgrade):
            reader, writer = await running.connect()
            try:
                writer.write(request)
                answer, body = await asyncio.wait_for(read_response(reader), 10)
                assert answer.status == 413 and json.loads(body)["code"] == "image_too_large"
                writer.write(b"x" * 10)
                assert await asyncio.wait_for(reader.read(), 10) == b"", "closed once the bound passed"
            finally:
                writer.close()
        reader, writer = await running.connect()
        try:
            writer.write(head + b"x" * 2_000_000 + predict(X_Request_ID="after"))
            first, _ = await asyncio.wait_for(read_response(reader), 10)
            second, _ = await asyncio.wait_for(read_response(reader), 10)
            assert (first.status, second.status, second.headers["x-request-id"]) == (413, 200, "after")
        finally:
            writer.close()


async def test_a_request_head_past_its_limit_is_431_and_the_connection_closes(make_settings: SettingsFactory) -> None:
    huge = predict(X_Request_ID="huge", X_Padding="x" * (connection.MAX_HEAD_BYTES + 1024))
    async with served(make_settings()) as running:
        ((head, body),) = await answers_then_close(running, huge, 1)
        assert running.reached == []
    envelope = json.loads(body)
    assert head.status == 431 and head.headers["connection"] == "close"  # type: ignore[attr-defined]
    assert envelope["code"] == "headers_too_large"
    # its X-Request-ID came before the head was cut off: the client can match the answer
    assert envelope["request_id"] == head.headers["x-request-id"] == "huge"  # type: ignore[attr-defined]


async def test_a_small_head_pipelined_behind_a_large_body_in_the_same_read_is_served(
    make_settings: SettingsFactory,
) -> None:
    """The body's bytes before a head, in the read the head begins in, are not the head's: they
    were counted as its own and a 60-byte request behind a 100 KB upload was refused 431."""
    upload = predict(body=b"\x89PNG\r\n\x1a\n" + bytes(100_000), X_Request_ID="upload")  # not an image: 400
    small = b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Request-ID: small\r\n\r\n"
    async with served(make_settings(server={"max_image_bytes": 1_000_000})) as running:
        reader, writer = await running.connect()
        try:
            writer.write(upload + small[:20])  # on loopback all of it is there for the server's next read
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(small[20:])
            first, _ = await asyncio.wait_for(read_response(reader), 10)
            second, body = await asyncio.wait_for(read_response(reader), 10)
        finally:
            writer.close()
    assert (first.status, first.headers["x-request-id"]) == (400, "upload")
    assert (second.status, second.headers["x-request-id"]) == (200, "small"), body


async def test_a_head_that_does_not_arrive_in_time_is_408_and_an_idle_connection_closes(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", 0.3)
    async with served(make_settings()) as running:
        # (httptools hands a header over when the next one begins: the id's comes before Host)
        started = predict().split(b"\r\n")[0] + b"\r\nX-Request-ID: slow\r\nHost: x\r\n"
        ((head, body),) = await answers_then_close(running, started, 1)
        reader, writer = await running.connect()  # connected, and never a byte
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()
        assert running.reached == []
        text = await _metrics_text(running)
    assert head.status == 408 and json.loads(body)["code"] == "request_timeout"  # type: ignore[attr-defined]
    assert json.loads(body)["request_id"] == head.headers["x-request-id"] == "slow"  # type: ignore[attr-defined]
    # timed from its first byte, as every answer is (it read about 0 s: timed from the refusal)
    (took,) = [
        v for k, v in metric_samples(text, f"{PREFIX}_request_duration_seconds_sum").items() if ("status", "408") in k
    ]
    assert took >= 0.3


async def test_a_client_gone_while_its_pipelined_request_runs_cancels_it(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # uvicorn flags only the last request parsed as disconnected: the one running (the first of
    # two pipelined) was computed for nobody, its write failed and was logged as an error
    settings = make_settings(
        server={"default_timeout_ms": 60_000}, batching={"normal": {"window_ms": 20_000.0, "max_batch": 4}}
    )
    async with served(settings) as running:
        sock = socket.create_connection(("127.0.0.1", running.port))
        try:
            sock.sendall(predict(X_Request_ID="first") + predict(X_Request_ID="second"))
            batcher = running.service.models["digits"].batcher
            async with asyncio.timeout(10):
                while batcher.queued(Lane.NORMAL) != 1:  # noqa: ASYNC110 - no event for it
                    await asyncio.sleep(0.01)
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
            sock.close()
        async with asyncio.timeout(10):
            while batcher.queued(Lane.NORMAL) != 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        text = await _metrics_text(running)
    assert batcher.batches == 0, "computed for nobody"
    assert metric_samples(text, f"{PREFIX}_cancellations_total")[(("reason", "cancelled"),)] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_requests_pipelined_behind_one_running_are_each_a_499_when_the_client_goes(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Read whole and waiting behind the running one, they never run: they were counted nowhere
    and logged nowhere, so the service's counts fell short of a proxy's."""
    settings = make_settings(
        logging={"access_log": True},
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 4}},
    )
    async with served(settings) as running:
        with caplog.at_level(logging.INFO, logger="app.access"):
            sock = socket.create_connection(("127.0.0.1", running.port))
            try:
                sock.sendall(b"".join(predict(X_Request_ID=f"piped-{i}") for i in range(4)))
                batcher = running.service.models["digits"].batcher
                async with asyncio.timeout(10):
                    while batcher.queued(Lane.NORMAL) != 1:  # noqa: ASYNC110 - no event for it
                        await asyncio.sleep(0.01)
            finally:
                sock.close()
            async with asyncio.timeout(10):
                while batcher.queued(Lane.NORMAL) != 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            text = await _metrics_text(running)
    requests_total = metric_samples(text, f"{PREFIX}_requests_total")
    assert requests_total[(("code", "client_closed_request"), ("status", "499"))] == 4
    logged = sorted(r.request_id for r in caplog.records if r.name == "app.access" and r.status == 499)  # type: ignore[attr-defined]
    assert logged == [f"piped-{i}" for i in range(4)]


async def test_a_head_past_its_limit_behind_a_request_is_answered_after_it(make_settings: SettingsFactory) -> None:
    huge = predict(X_Padding="x" * (connection.MAX_HEAD_BYTES + 1024), X_Request_ID="huge")
    async with served(make_settings()) as running:
        (first, first_body), (second, body) = await answers_then_close(running, predict(X_Request_ID="ok") + huge, 2)
        assert running.reached == ["POST /predict"]
    assert (first.status, first.headers["x-request-id"]) == (200, "ok")  # type: ignore[attr-defined]
    assert json.loads(first_body)["predictions"][0]["label"] == "3"
    assert second.status == 431 and json.loads(body)["code"] == "headers_too_large"  # type: ignore[attr-defined]


async def test_an_error_quotes_at_most_a_little_of_what_the_client_sent(make_settings: SettingsFactory) -> None:
    """A long key (up to the body's limit: a megabyte by default) or a 5,000-character model name
    is named in the error cut short, not echoed whole."""
    key = "k" * 60_000
    async with served(make_settings()) as running:
        body = json.dumps({key: 1}).encode()
        ((schema, schema_body),) = await running.exchange(predict(body=body, content_type="application/json"))
        ((missing, missing_body),) = await running.exchange(predict(path="/v1/models/" + "m" * 5000 + "/predict"))
    assert schema.status == 422 and len(schema_body) < 1000, len(schema_body)  # type: ignore[attr-defined]
    assert "k" * 64 + "..." in json.loads(schema_body)["message"]
    assert missing.status == 404 and len(missing_body) < 1000, len(missing_body)  # type: ignore[attr-defined]
    assert json.loads(missing_body)["code"] == "model_not_found"


async def test_admin_errors_quote_at_most_a_little_of_the_body(make_settings: SettingsFactory) -> None:
    from tests.integration.test_policy import AUTH, admin_settings

    key = "k" * 60_000
    async with running_app(admin_settings(make_settings)) as running:
        bodies = [
            ("/admin/models/digits/canary", {"weights": {}, key: 1}),  # an unknown key
            ("/admin/models/digits/canary", {"weights": {key: True}}),  # a version's share not a number
            ("/admin/policy", {key: 1}),
        ]
        for path, body in bodies:
            refused = await running.client.put(path, json=body, headers=AUTH)
            assert refused.status_code == 422 and len(refused.content) < 2000, (path, len(refused.content))


def _send_whole_then_read(port: int, head: bytes, body_bytes: int) -> tuple[bytes, bytes]:
    """As a blocking client such as ``http.client`` does: the request's every byte sent, then the
    answer read to the end of the stream. (A reset on either side raises.)"""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        chunk = b"x" * 65_536
        for start in range(0, body_bytes, len(chunk)):
            sock.sendall(chunk[: body_bytes - start])
        received = b""
        while data := sock.recv(65_536):
            received += data
    answer_head, _, body = received.partition(b"\r\n\r\n")
    return answer_head, body


@pytest.mark.parametrize("closing", ["Connection: close", "HTTP/1.0"])
async def test_an_early_answer_that_ends_the_connection_reaches_a_client_still_sending(
    make_settings: SettingsFactory, closing: str
) -> None:
    """A 413 on the declared length comes while the client is still sending its body; the answer
    ends the connection (the client asked so). Closed with the body unread, the kernel reset the
    connection: a client sending the whole body before it reads (``http.client``) saw a reset, not
    the 413. The body is read and dropped until the client has it and closes (RFC 9112, 9.6)."""
    size = 3 << 20  # over the 1 MiB limit, and more than the socket buffers hold
    head = predict().split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    head += f"\r\nContent-Length: {size}\r\n".encode()
    head += b"Connection: close\r\n\r\n" if closing == "Connection: close" else b"\r\n"
    if closing == "HTTP/1.0":
        head = head.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    async with served(make_settings(server={"max_image_bytes": 1 << 20})) as running:
        answer, body = await asyncio.to_thread(_send_whole_then_read, running.port, head, size)
        assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"413"
        assert json.loads(body)["code"] == "image_too_large"
        assert (await running.exchange(predict()))[0][0].status == 200, "and it serves on"


async def test_an_early_answer_to_a_client_waiting_for_100_continue_ends_the_connection(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asked ``Expect: 100-continue`` may send its body after a final answer or not:
    the answer says ``Connection: close`` and the connection ends (before, it waited for a body
    that might never come, and a reused connection lost its next request to it)."""
    monkeypatch.setattr(connection, "ANSWERED_BODY_S", 60.0)  # what the old code waited: past the read's bound
    head = predict().split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    head += b"\r\nContent-Length: 2000000\r\nExpect: 100-continue\r\n\r\n"
    async with served(make_settings(server={"max_image_bytes": 1 << 20})) as running:
        answer, body = await asyncio.to_thread(_send_whole_then_read, running.port, head, 0)
    lines = answer.split(b"\r\n")
    assert lines[0].split(b" ")[1] == b"413" and b"connection: close" in [line.lower() for line in lines]
    assert json.loads(body)["code"] == "image_too_large"


async def test_a_refusal_at_the_edge_that_ends_the_connection_reaches_a_client_still_sending(
    make_settings: SettingsFactory,
) -> None:
    size = 3 << 20  # within the limit: refused by admission at the edge, as soon as its head is read
    head = predict(X_Request_Timeout="1").split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    head += f"\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
    async with served(make_settings(server={"max_image_bytes": 8 << 20})) as running:
        await running.exchange(predict())  # a batch timed: a 1 ms deadline is refused at admission
        answer, body = await asyncio.to_thread(_send_whole_then_read, running.port, head, size)
        assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"503"
        assert json.loads(body)["code"] == "would_miss_deadline"
        assert running.reached == ["POST /predict"], "refused by the edge, not the app"


async def test_a_transfer_coding_other_than_chunked_is_refused_not_misread(make_settings: SettingsFactory) -> None:
    """The parser undoes ``chunked`` alone: a gzip coding before it reached the app still gzipped,
    and a valid image was answered "not a JPEG, PNG or WebP"."""
    import gzip

    coded = gzip.compress(sample_png(3))
    chunked = f"{len(coded):x}\r\n".encode() + coded + b"\r\n0\r\n\r\n"
    head = predict().split(b"\r\n\r\n", 1)[0].replace(b"Content-Length: ", b"X-Was: ")
    async with served(make_settings()) as running:
        ((answer, body),) = await running.exchange(head + b"\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + chunked)
        assert answer.status == 415 and json.loads(body)["code"] == "unsupported_media_type"
        assert "Transfer-Encoding gzip, chunked" in json.loads(body)["message"]
        plain = f"{len(sample_png(3)):x}\r\n".encode() + sample_png(3) + b"\r\n0\r\n\r\n"
        ((answer, _),) = await running.exchange(head + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + plain)
        assert answer.status == 200, "chunked alone is read as ever"


@pytest.mark.parametrize("hosts", [[], ["a", "b"]], ids=["none", "two"])
async def test_an_http_1_1_request_without_one_host_is_a_400(make_settings: SettingsFactory, hosts: list[str]) -> None:
    """RFC 9112, 3.2: MUST be a 400 (it was served)."""
    request = b"GET /livez HTTP/1.1\r\n" + b"".join(f"Host: {h}\r\n".encode() for h in hosts) + b"\r\n"
    async with served(make_settings()) as running:
        ((head, body),) = await answers_then_close(running, request, 1)
        assert head.status == 400 and json.loads(body)["code"] == "invalid_http"  # type: ignore[attr-defined]
        assert "Host" in json.loads(body)["message"]
        ((head, _),) = await running.exchange(b"GET /livez HTTP/1.0\r\n\r\n")
        assert head.status == 200, "HTTP/1.0 needs none"


async def test_a_431_reaches_a_client_still_sending_its_head(make_settings: SettingsFactory) -> None:
    """A head refused past its limit while the client still sends it: the socket closed with those
    bytes unread, the kernel reset the connection and the client saw the reset, not the 431."""
    head = predict(X_Request_ID="huge").split(b"\r\n\r\n", 1)[0] + b"\r\n"
    padding = b"X-Padding: " + b"x" * (3 << 20) + b"\r\n\r\n"  # far past the limit, more than the buffers hold
    async with served(make_settings()) as running:
        answer, body = await asyncio.to_thread(_send_whole_then_read, running.port, head + padding, 0)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"431"
    assert json.loads(body)["code"] == "headers_too_large"
