"""Spans under real concurrency: stages per request, one batch span linked to its requests."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from asgi_lifespan import LifespanManager
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from app.batching import Lane
from app.main import create_app
from tests.conftest import SettingsFactory
from tests.faults import DeviceLost, Faulty
from tests.integration.test_lifecycle_api import AUTH, ROOT, TOKEN, add_version
from tests.support import MODEL_NAME, running_app, sample_png, state_per_request, wait_queued

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@contextlib.asynccontextmanager
async def traced_app(
    settings, export: bool = True, root_path: str = ""
) -> AsyncIterator[tuple[httpx.AsyncClient, InMemorySpanExporter, object]]:  # type: ignore[no-untyped-def]
    """The app with an in-memory span exporter in place of the configured one (``export``),
    or with the settings' own (``telemetry.exporter="none"``: nothing exported); served under
    ``root_path`` as a server mounting it there would (the client's paths then begin with it)."""
    exporter = InMemorySpanExporter()
    app = create_app(settings, span_exporter=exporter if export else None)
    async with LifespanManager(state_per_request(app)) as manager:
        await app.state.starting
        transport = httpx.ASGITransport(app=manager.app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, exporter, app.state.tracer_provider


def held_batches(make_settings: SettingsFactory, max_batch: int, max_queue: int, **server: object):  # type: ignore[no-untyped-def]
    """Traced settings (the console exporter, replaced by the in-memory one) whose normal batches
    go when full: a window no test outlasts, under a deadline longer than it."""
    return make_settings(
        server={"default_timeout_ms": 60_000, **server},
        batching={"normal": {"window_ms": 20_000.0, "max_batch": max_batch, "max_queue": max_queue}},
        telemetry={"exporter": "console"},
    )


async def test_a_batch_span_links_every_request_span_and_each_request_has_its_stages(
    make_settings: SettingsFactory,
) -> None:
    settings = held_batches(make_settings, 4, 16)
    async with traced_app(settings) as (client, exporter, provider):
        ids = [f"req-{i}" for i in range(4)]
        responses = await asyncio.gather(
            *(
                client.post(
                    "/predict",
                    content=sample_png(i),
                    headers={"Content-Type": "image/png", "X-Request-ID": rid},
                )
                for i, rid in enumerate(ids)
            )
        )
        assert [r.status_code for r in responses] == [200] * 4
        await client.get("/healthz")
        await client.get("/readyz")
        await client.get("/metrics")
        provider.force_flush()  # type: ignore[attr-defined]
    spans = exporter.get_finished_spans()
    batches = [s for s in spans if s.name == "batch"]
    assert len(batches) == 1
    batch = batches[0]
    assert batch.attributes["batch.size"] == 4 and batch.attributes["batch.lane"] == "normal"
    assert batch.attributes["model.name"] == "digits" and batch.attributes["model.dtype"] == "float32"
    assert sorted(batch.attributes["request.ids"]) == ids
    servers = {s.attributes["request.id"]: s for s in spans if s.kind.name == "SERVER"}
    assert set(servers) == set(ids), "probes, readiness and scrapes make no spans"
    linked = {link.context.span_id for link in batch.links}
    assert linked == {s.context.span_id for s in servers.values()}
    for rid, server in servers.items():
        stages = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id}
        assert {"preprocess", "queue", "inference", "postprocess"} <= set(stages), (rid, sorted(stages))
        for stage in ("preprocess", "queue", "inference", "postprocess"):
            assert stages[stage].attributes["request.id"] == rid
            assert stages[stage].context.trace_id == server.context.trace_id
        assert stages["queue"].end_time <= stages["inference"].end_time
        inference = stages["inference"]  # leads from the request's trace to its batch's
        assert [link.context.span_id for link in inference.links] == [batch.context.span_id]
        assert inference.attributes["batch.trace_id"] == format(batch.context.trace_id, "032x")
    for response, rid in zip(responses, ids, strict=True):
        assert response.headers["x-trace-id"] == format(servers[rid].context.trace_id, "032x")


async def test_an_incoming_traceparent_is_continued(make_settings: SettingsFactory) -> None:
    settings = make_settings(telemetry={"exporter": "console"})
    async with traced_app(settings) as (client, exporter, provider):
        response = await client.post(
            "/predict", content=sample_png(2), headers={"Content-Type": "image/png", "traceparent": PARENT}
        )
        assert response.status_code == 200
        assert response.headers["x-trace-id"] == TRACE_ID
        provider.force_flush()  # type: ignore[attr-defined]
    server = next(s for s in exporter.get_finished_spans() if s.kind.name == "SERVER")
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == "00f067aa0ba902b7"


@pytest.mark.usefixtures("no_hurry")  # it expires in the queue, as behind a busy device
async def test_a_failed_request_marks_its_queue_span(make_settings: SettingsFactory) -> None:
    settings = held_batches(make_settings, 4, 16)
    async with traced_app(settings) as (client, exporter, provider):
        response = await client.post(
            "/predict",
            content=sample_png(2),
            headers={"Content-Type": "image/png", "X-Request-Timeout": "100", "X-Request-ID": "late-1"},
        )
        assert response.status_code == 503
        provider.force_flush()  # type: ignore[attr-defined]
    queue = next(s for s in exporter.get_finished_spans() if s.name == "queue")
    assert queue.status.status_code.name == "ERROR" and queue.attributes["request.id"] == "late-1"


@pytest.mark.parametrize("exporter", ["none", "console"])
async def test_a_global_tracer_provider_adds_no_spans_of_its_own(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch, exporter: str
) -> None:
    """FastAPI's own telemetry turns itself on when global OpenTelemetry providers are set
    (``opentelemetry-instrument``, or FastAPI's OTLP auto-configuration from the environment).
    The service's settings say what is traced: with no exporter nothing is (spans cost the
    request path), and with one the service's spans are the only ones."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    global_exporter = InMemorySpanExporter()
    global_provider = TracerProvider()
    global_provider.add_span_processor(SimpleSpanProcessor(global_exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", global_provider)
    assert trace.get_tracer_provider() is global_provider
    settings = make_settings(telemetry={"exporter": exporter})
    async with traced_app(settings, export=exporter != "none") as (client, ours, provider):
        response = await client.post("/predict", content=sample_png(2), headers={"Content-Type": "image/png"})
        assert response.status_code == 200
        assert (await client.get("/v1/models")).status_code == 200
        provider.force_flush()  # type: ignore[attr-defined]
    servers = [s.name for s in ours.get_finished_spans() if s.kind.name == "SERVER"]
    assert servers == ([] if exporter == "none" else ["POST /predict", "GET /v1/models"])
    assert global_exporter.get_finished_spans() == ()


async def test_batches_of_a_version_loaded_through_the_admin_api_join_no_admin_trace(
    make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """The version's batcher starts while the admin request is served; its batches must not run
    in that request's context, or each would be a child of the admin request in its trace."""
    shutil.copytree(ROOT / "models" / "digits" / "1", tmp_path / "digits" / "1")
    settings = make_settings(
        model={"repository": tmp_path, "load_versions": "latest", "default_versions": {"digits": "1"}},
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0},
        telemetry={"exporter": "console"},  # replaced by the in-memory exporter
    )
    async with traced_app(settings) as (client, exporter, provider):
        add_version(tmp_path, "2")
        loaded = await client.post("/admin/models/digits/versions/2/load", headers={**AUTH, "X-Request-ID": "load"})
        assert loaded.status_code == 200, loaded.text
        headers = {"Content-Type": "image/png", "X-Model-Version": "2", "X-Request-ID": "predict"}
        answered = await client.post("/predict", content=sample_png(3), headers=headers)
        assert answered.status_code == 200 and answered.json()["version"] == "2"
        provider.force_flush()  # type: ignore[attr-defined]
    spans = exporter.get_finished_spans()
    servers = {s.attributes["request.id"]: s for s in spans if s.kind.name == "SERVER"}
    (batch,) = [s for s in spans if s.name == "batch"]
    assert batch.parent is None, "a batch is a trace of its own, linked to its requests"
    assert batch.context.trace_id != servers["load"].context.trace_id
    assert [link.context.span_id for link in batch.links] == [servers["predict"].context.span_id]
    # the load's phases on its own span (it was one bare span of half a second)
    events = [e.name for e in servers["load"].events]
    assert events[-1] == "model ready" and servers["load"].events[-1].attributes["model.version"] == "2", events


async def test_a_policy_change_is_on_its_admin_calls_span(make_settings: SettingsFactory) -> None:
    settings = make_settings(
        admin={"enabled": True, "token": TOKEN, "config_watch_s": 0}, telemetry={"exporter": "console"}
    )
    async with traced_app(settings) as (client, exporter, provider):
        changed = await client.put(
            "/admin/policy", headers={**AUTH, "X-Request-ID": "put"}, json={"normal": {"window_ms": 7}}
        )
        assert changed.status_code == 200, changed.text
        provider.force_flush()  # type: ignore[attr-defined]
    (server,) = [s for s in exporter.get_finished_spans() if s.attributes.get("request.id") == "put"]
    (event,) = [e for e in server.events if e.name == "batching policy changed"]
    assert event.attributes["source"] and '"window_ms": 7.0' in event.attributes["policy"]


def _traceparent(sampled: bool) -> str:
    return f"00-{TRACE_ID}-00f067aa0ba902b7-{'01' if sampled else '00'}"


@pytest.mark.parametrize("ratio", [0.0, 0.5])
async def test_the_batch_of_a_sampled_request_is_sampled_too(make_settings: SettingsFactory, ratio: float) -> None:
    """The caller sampled this trace (parent-based sampling keeps it): its request's spans are
    exported, and its ``inference`` span links to a batch span, which must be exported as well.
    The batch span is a root span, sampled by the ratio on its own trace id."""
    settings = make_settings(telemetry={"exporter": "console", "sampling_ratio": ratio})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        for _ in range(8):
            answered = await running.predict_png(sample_png(3), headers={"traceparent": _traceparent(True)})
            assert answered.status_code == 200
        running.app.state.tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    inference = [s for s in spans if s.name == "inference"]
    assert len(inference) == 8, "the requests' own spans follow the caller's decision"
    batches = {s.context.span_id for s in spans if s.name == "batch"}
    missing = [s for s in inference if s.links[0].context.span_id not in batches]
    assert not missing, f"{len(missing)} of 8 sampled requests link to a batch span that was never exported"


async def test_no_batch_span_is_exported_for_requests_nobody_samples(make_settings: SettingsFactory) -> None:
    """The caller did not sample its trace: none of the request's spans are exported, so a batch
    of it alone links to nothing that exists."""
    settings = make_settings(telemetry={"exporter": "console", "sampling_ratio": 1.0})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        answered = await running.predict_png(sample_png(3), headers={"traceparent": _traceparent(False)})
        assert answered.status_code == 200
        running.app.state.tracer_provider.force_flush()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == [], f"exported {names} for a trace the caller did not sample"


async def test_a_failed_batch_leaves_its_error_on_the_inference_span_linked_to_the_batch(
    make_settings: SettingsFactory,
) -> None:
    """A device lost (or OOM at one image, or a bug in the runner) fails the whole batch. The
    request's trace must still lead to its batch (the way back is the inference span's link),
    and the error belongs to inference, not to the queue, which did its job."""
    settings = make_settings(telemetry={"exporter": "console"})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served_model = running.service.models[MODEL_NAME]
        served_model.runner.model = DeviceLost(served_model.model)  # type: ignore[assignment]
        answered = await running.predict_png(sample_png(3), headers={"X-Request-ID": "lost-1"})
        assert answered.status_code == 503 and answered.json()["code"] == "device_unavailable"
        running.app.state.tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "batch"]
    assert batch.status.status_code.name == "ERROR"
    own = {s.name: s for s in spans if s.attributes.get("request.id") == "lost-1"}
    assert own["queue"].status.status_code.name != "ERROR", "the queue span carries the device's failure"
    assert "inference" in own, "no span of the request links back to the batch that failed it"
    assert own["inference"].status.status_code.name == "ERROR"
    assert [link.context.span_id for link in own["inference"].links] == [batch.context.span_id]


@pytest.mark.parametrize("mount", ["", "/tight"], ids=["at the root", "under a prefix"])
async def test_only_the_probe_and_scrape_paths_themselves_are_untraced(
    make_settings: SettingsFactory, mount: str
) -> None:
    # under a prefix (uvicorn's --root-path, a Ray Serve route_prefix) the path holds it
    settings = make_settings(telemetry={"exporter": "console"})
    async with traced_app(settings, root_path=mount) as (client, exporter, provider):
        for path in ("/livez", "/readyz", "/healthz", "/metrics"):
            probe = await client.get(mount + path, headers={"X-Request-ID": f"probe{path.replace('/', '-')}"})
            assert probe.status_code == 200, path
        traced = {
            "model-named-after-a-scrape": ("POST", "/v1/models/metrics-net/predict"),
            "model-named-after-a-probe": ("POST", "/v1/models/healthz/predict"),
            "model-info-named-after-a-scrape": ("GET", "/v1/models/metrics"),
            "past-a-scrape": ("GET", "/metrics/extra"),
            "probe-of-another-mount": ("GET", "/other/readyz"),
        }
        for request_id, (method, path) in traced.items():
            await client.request(method, mount + path, headers={"X-Request-ID": request_id})
        provider.force_flush()  # type: ignore[attr-defined]
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert sorted(s.attributes["request.id"] for s in servers) == sorted(traced)


async def test_a_host_header_naming_a_probe_leaves_the_prediction_in_its_trace(make_settings: SettingsFactory) -> None:
    async with traced_app(make_settings(telemetry={"exporter": "console"})) as (client, exporter, provider):
        answer = await client.post(
            "/predict",
            content=sample_png(3),
            headers={"Content-Type": "image/png", "Host": "api.example.com/metrics"},
        )
        assert answer.status_code == 200 and "x-trace-id" in answer.headers
        await client.get("/metrics")
        provider.force_flush()  # type: ignore[attr-defined]
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(servers) == 1 and servers[0].attributes["request.id"] == answer.headers["x-request-id"]
    stages = [s for s in spans if s.name in ("preprocess", "queue", "inference", "postprocess")]
    assert stages and {s.context.trace_id for s in stages} == {servers[0].context.trace_id}


async def test_a_batch_of_more_than_128_requests_links_every_one(make_settings: SettingsFactory) -> None:
    size = 130  # the SDK keeps 128 links a span unless told otherwise
    settings = held_batches(make_settings, size, 2 * size)
    async with traced_app(settings) as (client, exporter, provider):
        png = sample_png(5)
        answers = await asyncio.gather(
            *(client.post("/predict", content=png, headers={"Content-Type": "image/png"}) for _ in range(size))
        )
        assert {(a.status_code, a.json()["batch_size"]) for a in answers} == {(200, size)}
        provider.force_flush()  # type: ignore[attr-defined]
    batch = next(s for s in exporter.get_finished_spans() if s.name == "batch")
    assert len(batch.links) == size and batch.dropped_links == 0


async def test_batch_spans_name_the_precision_that_serves_after_the_cpu_fallback(
    make_settings: SettingsFactory,
) -> None:
    settings = make_settings(
        model={"dtype": "float16", "cpu_fallback": True, "fallback_after_failures": 1},
        telemetry={"exporter": "console"},
    )
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served = running.service.models[MODEL_NAME]
        served.runner.model = DeviceLost(served.model)  # type: ignore[assignment]
        assert (await running.predict_png(sample_png(3))).status_code == 200
        running.app.state.tracer_provider.force_flush()
    batches = [s for s in exporter.get_finished_spans() if s.name == "batch"]
    # one batch: the lost device failed it, and the fallback, loaded within it, computed it
    assert [(s.attributes["device"], s.attributes["model.dtype"]) for s in batches] == [("cpu", "float32")]


async def test_every_request_of_a_batch_shows_the_batchs_own_times(make_settings: SettingsFactory) -> None:
    # a request's queue ends, and its inference runs, when its batch did: not when its coroutine
    # resumed afterwards (later the further down the batch it was)
    settings = held_batches(make_settings, 16, 64)
    async with traced_app(settings) as (client, exporter, provider):
        answers = await asyncio.gather(
            *(
                client.post("/predict", content=sample_png(i % 10), headers={"Content-Type": "image/png"})
                for i in range(16)
            )
        )
        assert {(a.status_code, a.json()["batch_size"]) for a in answers} == {(200, 16)}
        provider.force_flush()  # type: ignore[attr-defined]
    spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "batch"]
    inference = [s for s in spans if s.name == "inference"]
    queue_ends = {s.end_time for s in spans if s.name == "queue"}
    assert len(inference) == 16
    ((started, ended),) = {(s.start_time, s.end_time) for s in inference}
    assert queue_ends == {started}
    assert started <= batch.start_time and ended >= batch.end_time  # type: ignore[operator]


async def test_a_deadline_passing_while_its_batch_runs_ends_the_queue_span_at_the_dispatch_and_leads_to_the_batch(
    make_settings: SettingsFactory,
) -> None:
    """Answered 503 at its deadline while the device computes its batch: the queue's part ended
    when the batch started, and the request's trace must still lead to the batch (it blamed the
    queue up to the deadline, with no link)."""
    settings = make_settings(telemetry={"exporter": "console"})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        served = running.service.models[MODEL_NAME]
        inner = served.model
        started, release = threading.Event(), threading.Event()

        class Held(Faulty):  # the batch runs until the test lets it end
            def probabilities(self, images: torch.Tensor, head: str | None = None) -> torch.Tensor:
                started.set()
                release.wait(10)
                return inner.probabilities(images, head)

        served.runner.model = Held(inner)  # type: ignore[assignment]
        # a deadline the request outlives only at the device, whatever the load (the test waits it out)
        request = asyncio.ensure_future(
            running.predict_png(
                sample_png(3),
                headers={"X-Request-ID": "late-in-batch", "X-Request-Timeout": "1000", "X-Urgency": "high"},
            )
        )
        assert await asyncio.to_thread(started.wait, 10)
        answered = await request
        release.set()
        assert answered.status_code == 503 and answered.json()["code"] == "deadline_exceeded"
    # read once the app closed: its close waited for the batch to end, then flushed every span
    spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "batch"]
    own = {s.name: s for s in spans if s.attributes.get("request.id") == "late-in-batch"}
    assert own["queue"].status.status_code.name != "ERROR"
    # ended as the batch was dispatched (just before its span began), not at the deadline, which
    # passed while the batch ran; its inference part starts there
    assert own["queue"].end_time <= batch.start_time  # type: ignore[operator]
    assert own["inference"].start_time == own["queue"].end_time
    assert own["inference"].status.status_code.name == "ERROR"
    assert "deadline_exceeded" in own["inference"].status.description
    assert [link.context.span_id for link in own["inference"].links] == [batch.context.span_id]


@pytest.mark.parametrize("decode", ["pool", "batch"])
async def test_a_clients_mistake_or_its_going_marks_no_span_failed(make_settings: SettingsFactory, decode: str) -> None:
    """Jaeger's error search should list the service's failures, not every bad upload or client
    that gave up: the exception is recorded, the status left unset. What is no image at all is
    refused at preprocessing wherever images are decoded."""
    settings = held_batches(make_settings, 4, 16, decode=decode)
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        bad = await running.client.post(
            "/predict", content=b"not an image", headers={"Content-Type": "image/png", "X-Request-ID": "bad-1"}
        )
        assert bad.status_code == 400
        gone = asyncio.ensure_future(running.predict_png(sample_png(4), headers={"X-Request-ID": "gone-1"}))
        await wait_queued(running, Lane.NORMAL, 1)  # queued, under a window no test outlasts
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    spans = exporter.get_finished_spans()  # the app's close flushed them
    preprocess = next(s for s in spans if s.name == "preprocess" and s.attributes.get("request.id") == "bad-1")
    assert preprocess.status.status_code.name != "ERROR"
    assert [event.name for event in preprocess.events] == ["exception"]
    queue = next(s for s in spans if s.name == "queue" and s.attributes.get("request.id") == "gone-1")
    assert queue.status.status_code.name != "ERROR" and [event.name for event in queue.events] == ["client went"]


async def test_an_image_its_batch_cannot_decode_is_answered_alone_and_fails_no_span(
    make_settings: SettingsFactory,
) -> None:
    """Decoded by its batch's device thread (``server.decode=batch``), a PNG broken past its header
    gets its 400 in the one envelope; the batch's other requests their answers; the trace shows
    the client's mistake on its ``inference`` span without failing it or the batch."""
    settings = held_batches(make_settings, 3, 16, decode="batch")
    async with traced_app(settings) as (client, exporter, _):
        ids = ["fine-1", "broken-1", "fine-2"]
        bodies = [sample_png(1), sample_png(2)[:60], sample_png(3)]  # the second: signature and header only
        answers = await asyncio.gather(
            *(
                client.post("/predict", content=body, headers={"Content-Type": "image/png", "X-Request-ID": rid})
                for rid, body in zip(ids, bodies, strict=True)
            )
        )
    assert [a.status_code for a in answers] == [200, 400, 200]
    refused = answers[1].json()
    assert refused["code"] == "undecodable_image" and refused["request_id"] == "broken-1"
    assert all(a.json()["timings"]["preprocess"] > 0 for a in (answers[0], answers[2])), "its own decode counts"
    spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "batch"]
    assert batch.status.status_code.name != "ERROR" and batch.attributes["batch.size"] == 3
    assert batch.attributes["batch.decoded"] == 2 and batch.attributes["batch.decode_ms"] > 0
    assert batch.attributes["batch.refused"] == 1
    # what its requests' spans and answers give as batch.size: those its device ran
    assert batch.attributes["batch.computed"] == 2 == answers[0].json()["batch_size"]
    # each answer's preprocessing counts its image's decode: together they are the batch's decoding
    # (which adds only the loop around them), not the microseconds of the checks up front
    preprocessed_ms = sum(a.json()["timings"]["preprocess"] for a in (answers[0], answers[2]))
    assert preprocessed_ms >= 0.5 * batch.attributes["batch.decode_ms"]  # type: ignore[operator]
    own = {s.name: s for s in spans if s.attributes.get("request.id") == "broken-1"}
    assert own["preprocess"].status.status_code.name != "ERROR" and not own["preprocess"].events
    assert own["inference"].status.status_code.name != "ERROR"
    assert [event.name for event in own["inference"].events] == ["exception"]
    assert [link.context.span_id for link in own["inference"].links] == [batch.context.span_id]


async def test_a_server_span_says_why_it_was_refused_and_what_served_it(make_settings: SettingsFactory) -> None:
    """In Jaeger a refusal is one span, with no child to say its cause: the service's error code
    is on it (``error.type`` too for a 5xx), with the lane and the version of a prediction; and
    the URL keeps no query value the API does not read."""
    settings = make_settings(telemetry={"exporter": "console"})
    exporter = InMemorySpanExporter()
    async with running_app(settings, span_exporter=exporter) as running:
        ok = await running.predict_png(sample_png(1), headers={"X-Request-ID": "ok-1", "X-Urgency": "high"})
        assert ok.status_code == 200
        late = await running.predict_png(sample_png(2), headers={"X-Request-ID": "late-1", "X-Request-Timeout": "1"})
        assert late.status_code == 503
        bad = await running.client.post(
            "/predict?top_k=2&api_key=SHOULD-NOT-LEAK",
            content=b"{",
            headers={"Content-Type": "application/json", "X-Request-ID": "bad-1"},
        )
        assert bad.status_code == 400
    servers = {
        s.attributes["request.id"]: s.attributes
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.SERVER and "request.id" in s.attributes
    }
    assert servers["ok-1"]["lane"] == "urgent" and "error.code" not in servers["ok-1"]
    assert (servers["ok-1"]["model.name"], servers["ok-1"]["model.version"]) == (MODEL_NAME, "1")
    code = late.json()["code"]
    assert (servers["late-1"]["error.code"], servers["late-1"]["error.type"]) == (code, code)
    assert (servers["late-1"]["lane"], servers["late-1"]["model.name"]) == ("normal", MODEL_NAME)
    assert servers["bad-1"]["error.code"] == bad.json()["code"] and "error.type" not in servers["bad-1"]
    assert servers["bad-1"]["http.url"].endswith("/predict?top_k=2&REDACTED"), "no name kept either: a token may be one"
