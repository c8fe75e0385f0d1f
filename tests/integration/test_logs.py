"""Logs: one JSON object a line, the request id on each line of a request, never a payload."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.inference import preprocess
from app.telemetry.logging import JsonFormatter, RequestIdFilter
from tests.conftest import SettingsFactory
from tests.faults import Faulty
from tests.support import MODEL_NAME, b64, running_app, sample_png

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def test_request_lines_are_json_with_the_request_id_and_no_payload(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(logging={"access_log": True, "level": "DEBUG"})
    image = sample_png(4)
    encoded = b64(image)
    caplog.handler.addFilter(RequestIdFilter())
    async with running_app(settings) as running:
        with caplog.at_level(logging.DEBUG):
            ok = await running.client.post(
                "/predict",
                json={"image_base64": encoded},
                headers={"X-Request-ID": "log-check-1", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
            )
            bad = await running.client.post(
                "/predict", json={"image_base64": encoded[:-3] + "!!!"}, headers={"X-Request-ID": "log-check-2"}
            )
    assert ok.status_code == 200 and bad.status_code == 400
    formatter = JsonFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    parsed = [json.loads(line) for line in lines]
    access = [p for p in parsed if p["logger"] == "app.access"]
    assert {(p["request_id"], p["status"]) for p in access} >= {("log-check-1", 200), ("log-check-2", 400)}
    served = next(p for p in access if p["request_id"] == "log-check-1")
    assert served["model"] == "digits" and served["version"] == "1" and served["lane"] == "normal"
    # tracing is off (no exporter), so the lines carry the caller's trace: they join its trace
    assert (served["trace_id"], served["span_id"]) == (TRACE_ID, PARENT_ID)
    assert ok.headers["x-trace-id"] == TRACE_ID
    assert "trace_id" not in next(p for p in access if p["request_id"] == "log-check-2")
    assert served["batch_size"] == 1 and set(served["timings_ms"]) == {"preprocess", "queue", "inference", "total"}
    for entry in parsed:
        assert {"timestamp", "level", "logger", "message", "request_id"} <= set(entry)
    text = "\n".join(lines)
    assert encoded[:64] not in text and encoded[-64:] not in text
    assert repr(image[:32])[2:-1] not in text


async def test_a_batch_the_model_fails_logs_its_traceback_once_not_once_more_for_each_request(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 3, "max_queue": 16}},
    )

    class Broken(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            raise ValueError("a bug in the model's code")

    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = Broken(served.model)  # type: ignore[assignment]
        with caplog.at_level(logging.ERROR):
            answers = await asyncio.gather(
                *(running.predict_png(sample_png(d), headers={"X-Request-ID": f"bug-{d}"}) for d in range(3))
            )
    assert [(a.status_code, a.json()["code"]) for a in answers] == [(500, "internal_error")] * 3
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(with_traceback) == 1 and "batch of 3 failed" in with_traceback[0].getMessage()
    assert sorted(with_traceback[0].request_ids) == ["bug-0", "bug-1", "bug-2"], "the requests it failed"  # type: ignore[attr-defined]
    per_request = [r for r in caplog.records if r.getMessage().startswith("request failed")]
    assert len(per_request) == 3 and all("inference_failed" in r.getMessage() for r in per_request)


async def test_a_failed_batchs_traceback_line_names_the_batchs_span(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each request's 500 line says its traceback is logged with its batch: that line is logged
    once the batch's span has ended, and carries that span's ids to lead to it."""
    settings = make_settings(telemetry={"exporter": "console"})

    class Broken(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            raise ValueError("a bug in the model's code")

    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = Broken(served.model)  # type: ignore[assignment]
        with caplog.at_level(logging.ERROR):
            answered = await running.predict_png(sample_png(1), headers={"X-Request-ID": "bug-1"})
        assert answered.status_code == 500
    (batch,) = [s for s in exporter.get_finished_spans() if s.name == "batch"]
    (line,) = [r for r in caplog.records if r.exc_info]
    assert (line.trace_id, line.span_id) == (  # type: ignore[attr-defined]
        format(batch.context.trace_id, "032x"),
        format(batch.context.span_id, "016x"),
    )


async def test_a_long_path_is_cut_in_the_access_line(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The path is the client's string: a 60 KB one made a 120 KB access line (in the message
    and in its field), written on the event loop. It is cut as a span attribute is."""
    from app.api.access_log import LOGGED_PATH_CHARS

    path = "/" + "a" * 60_000
    async with running_app(make_settings(logging={"access_log": True})) as running:
        with caplog.at_level(logging.INFO, logger="app.access"):
            answered = await running.client.get(path)
    assert answered.status_code == 404
    (line,) = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "app.access"]
    assert line["path"] == path[:LOGGED_PATH_CHARS] + "..."
    assert len(json.dumps(line)) < 3 * LOGGED_PATH_CHARS, "the path twice at most, each cut"


async def test_a_bug_in_decoding_one_image_names_its_request_on_the_traceback_line(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's 500 line says its traceback is logged with its batch; with tracing off (the
    default) the traceback line, written on the device thread, is found by the request's id."""
    settings = make_settings(
        server={"decode": "batch", "default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 3, "max_queue": 16}},
    )
    broken = sample_png(2)
    decode = preprocess.Encoded.decode

    def buggy(self: preprocess.Encoded) -> torch.Tensor:
        if self.data == broken:
            raise KeyError("a bug in decoding")
        return decode(self)

    monkeypatch.setattr(preprocess.Encoded, "decode", buggy)
    async with running_app(settings) as running:
        with caplog.at_level(logging.ERROR):
            answers = await asyncio.gather(
                *(running.predict_png(sample_png(d), headers={"X-Request-ID": f"dec-{d}"}) for d in range(3))
            )
    assert [a.status_code for a in answers] == [200, 200, 500]
    (line,) = [r for r in caplog.records if r.exc_info]
    assert "decoding an image of a batch failed" in line.getMessage()
    assert line.request_ids == ["dec-2"]  # type: ignore[attr-defined]
    assert json.loads(JsonFormatter().format(line))["request_ids"] == ["dec-2"]


async def test_a_bug_in_a_part_of_a_split_batch_names_that_parts_requests_on_its_traceback_line(
    make_settings: SettingsFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch of 4 runs out of memory and is split; its first half computes, its second hits a
    bug: the traceback line, logged once for that half, names the requests answered 500."""
    settings = make_settings(
        server={"default_timeout_ms": 60_000},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": 4, "max_queue": 16}},
    )

    class BuggyAfter(Faulty):
        def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
            if len(self.sizes) == 2:
                self.sizes.append(len(images))
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            return super().probabilities(images, head)

    async with running_app(settings) as running:
        served = running.service.models[MODEL_NAME]
        buggy = BuggyAfter(served.model, fail_at=4)
        served.runner.model = buggy  # type: ignore[assignment]
        with caplog.at_level(logging.ERROR):
            answers = await asyncio.gather(
                *(running.predict_png(sample_png(d), headers={"X-Request-ID": f"split-{d}"}) for d in range(4))
            )
    assert buggy.sizes == [4, 2, 2]
    failed = sorted(a.headers["x-request-id"] for a in answers if a.status_code == 500)
    assert len(failed) == 2 and sorted(a.status_code for a in answers) == [200, 200, 500, 500]
    (line,) = [r for r in caplog.records if r.exc_info]
    assert line.getMessage().startswith("part of a batch")
    assert sorted(line.request_ids) == failed  # type: ignore[attr-defined]
