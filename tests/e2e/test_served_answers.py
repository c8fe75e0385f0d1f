"""What a client reads from ``ai-backend serve`` itself (uvicorn on uvloop, the edge in front):
the answers' timings, and which error comes first when several could."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess, spawn
from tests.support import sample_png, server_environment

ADMIN_TOKEN = "served-answers-admin-token-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs: Path = tmp_path_factory.mktemp("served-answers")
    env = server_environment({"AI_SERVICE_ADMIN__ENABLED": "true", "AI_SERVICE_ADMIN__TOKEN": ADMIN_TOKEN})
    running = ServerProcess(spawn(logs, env), logs)
    try:
        running.wait_ready()
        with httpx.Client(base_url=running.url, timeout=10.0) as client:  # a batch timed in each lane
            for urgency in ("normal", "high"):
                answered = client.post(
                    "/predict", content=sample_png(7), headers={"Content-Type": "image/png", "X-Urgency": urgency}
                )
                assert answered.status_code == 200
        yield running
    finally:
        running.stop()


def test_timings_are_not_whole_milliseconds(server: ServerProcess) -> None:
    # uvloop's loop.time() counts whole milliseconds: a batcher timed on it reported a 0.3 ms
    # forward pass as 1.0 or 2.0, and its histograms and admission's estimate the same way
    values: list[float] = []
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        for _ in range(12):
            answered = client.post("/predict", content=sample_png(7), headers={"Content-Type": "image/png"})
            assert answered.status_code == 200
            timings = answered.json()["timings"]
            values += [timings["queue"], timings["inference"]]
    assert not all(float(v).is_integer() for v in values), f"every timing is a whole millisecond: {values}"


def test_a_deadline_under_the_lanes_window_is_served_on_an_idle_lane(server: ServerProcess) -> None:
    # on an idle normal lane (25 ms window) a request used to wait its window, then its batch ran: a
    # 20 ms deadline was refused (503 would_miss_deadline) and told to retry a request no retry
    # would serve. It hurries now: its lane's batch goes at once
    headers = {"Content-Type": "image/png"}
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        assert client.post("/predict", content=sample_png(7), headers=headers).status_code == 200  # a batch timed
        served = [
            client.post("/predict", content=sample_png(7), headers={**headers, "X-Request-Timeout": "20"})
            for _ in range(3)
        ]
    assert [answer.status_code for answer in served] == [200] * 3, [answer.text for answer in served]
    assert all(answer.json()["timings"]["queue"] < 20 for answer in served)


def _declared_only(port: int, head: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    """Send a request's head alone (its body declared, never sent) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        top, _, rest = received.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines[1:])}
        while len(rest) < int(headers["content-length"]):
            rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(rest)


@pytest.mark.parametrize(
    ("content_type", "length", "target", "status", "code"),
    [
        ("text/plain", 12, "/predict", 415, "unsupported_media_type"),
        ("image/png", 64 << 20, "/predict", 413, "image_too_large"),
        ("image/png", 0, "/predict", 400, "empty_body"),
        ("application/json", 0, "/predict", 400, "invalid_json"),
        ("image/png", 12, "/predict?top_k=abc", 422, "validation_error"),
        ("image/png", 12, "/predict?top_k=0", 422, "validation_error"),
        ("image/png", 12, "/predict?top_k=11", 422, "validation_error"),  # the bundled model has ten classes
    ],
    ids=[
        "media-type",
        "declared-length",
        "empty-image",
        "empty-json",
        "query-top-k-not-a-number",
        "query-top-k-0",
        "query-top-k-over-the-classes",
    ],
)
def test_a_request_no_retry_mends_is_a_4xx_before_any_503(
    server: ServerProcess, content_type: str, length: int, target: str, status: int, code: str
) -> None:
    # with a deadline admission refuses, the 503 (and its Retry-After) came first, and a client
    # retried a request that could never succeed; the edge and the route check the request line
    # and the headers first
    head = (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nX-Request-Timeout: 10\r\n\r\n"
    ).encode()
    answered_status, headers, body = _declared_only(server.port, head)
    assert (answered_status, body["code"]) == (status, code), body
    assert "retry-after" not in headers


def test_a_wrong_admin_token_is_told_in_plain_words(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        answered = client.get("/admin/policy", headers={"Authorization": "Bearer not-the-token-123456"})
    assert answered.status_code == 403
    assert answered.json()["message"] == "the bearer token is not an admin token"
