"""How the OTLP exporters reach a collector: TLS, the endpoint and the timeout, from our settings
and from the standard ``OTEL_EXPORTER_OTLP_*`` variables where ours say nothing.

Spans go through the real provider and processor (``build_tracer_provider``) to real receivers on
loopback: a gRPC collector, plaintext or TLS with a client certificate required (the certificates
made here), and the OTLP/HTTP receiver of the end-to-end tests."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from app.settings import SettingsError, TelemetrySettings, load_settings
from app.telemetry.tracing import build_tracer_provider, export_timeout_s
from tests.e2e.test_otlp import Receiver

ARRIVAL_TIMEOUT_S = 10.0  # bounds a failure only: an export that works takes milliseconds
EXPORT_TIMEOUT_S = 2.0  # an export that cannot connect retries until this, then gives up


@pytest.fixture(autouse=True)
def no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it is about, and no others."""
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC traces endpoint that keeps the names of the spans it is sent."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.arrived = threading.Event()

    def Export(  # noqa: N802 (the service's name for it)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.names.extend(span.name for span in scope_spans.spans)
        self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def collector(credentials: grpc.ServerCredentials | None = None) -> Iterator[tuple[Collector, int]]:
    """A gRPC collector on localhost (TLS with ``credentials``), and its port."""
    kept = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(kept, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("localhost:0", credentials)
    server.start()
    try:
        yield kept, port
    finally:
        server.stop(grace=None).wait(10)


def _certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` (its own authority), and its key: files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / f"{name}.crt", folder / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


@pytest.fixture
def mutual_tls(tmp_path: Path) -> Iterator[tuple[Collector, int, dict[str, Path]]]:
    """A TLS collector that requires a client certificate, and the files a client needs."""
    server_cert, server_key = _certificate(tmp_path, "collector")
    client_cert, client_key = _certificate(tmp_path, "client")
    credentials = grpc.ssl_server_credentials(
        [(server_key.read_bytes(), server_cert.read_bytes())],
        root_certificates=client_cert.read_bytes(),
        require_client_auth=True,
    )
    with collector(credentials) as (kept, port):
        yield kept, port, {"CERTIFICATE": server_cert, "CLIENT_KEY": client_key, "CLIENT_CERTIFICATE": client_cert}


def _tls_variables(monkeypatch: pytest.MonkeyPatch, files: dict[str, Path], signal: str = "TRACES_") -> None:
    for name, path in files.items():
        monkeypatch.setenv(f"OTEL_EXPORTER_OTLP_{signal}{name}", str(path))


def _send(settings: TelemetrySettings, name: str = "probe") -> None:
    """One sampled span through the provider and processor ``settings`` make, flushed and shut down."""
    provider, processor = build_tracer_provider(settings)
    assert processor is not None
    with provider.get_tracer("test").start_as_current_span(name):
        pass
    processor.force_flush()
    provider.shutdown()


def _grpc(endpoint: str | None) -> TelemetrySettings:
    return TelemetrySettings(exporter="otlp_grpc", endpoint=endpoint, export_timeout_s=EXPORT_TIMEOUT_S)


def test_an_https_endpoint_uses_the_traces_certificate_variables(
    mutual_tls: tuple[Collector, int, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, port, files = mutual_tls
    _tls_variables(monkeypatch, files)
    _send(_grpc(f"https://localhost:{port}"))
    assert kept.arrived.wait(ARRIVAL_TIMEOUT_S), "no span over TLS with the traces' certificate files"
    assert kept.names == ["probe"]


def test_a_host_and_port_takes_tls_where_the_insecure_variable_says_so(
    mutual_tls: tuple[Collector, int, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, port, files = mutual_tls
    _tls_variables(monkeypatch, files, signal="")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "false")
    _send(_grpc(f"localhost:{port}"))
    assert kept.arrived.wait(ARRIVAL_TIMEOUT_S), "OTEL_EXPORTER_OTLP_INSECURE=false was not heeded"


def test_with_no_endpoint_set_the_exporter_takes_its_endpoint_and_tls_from_the_variables(
    mutual_tls: tuple[Collector, int, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, port, files = mutual_tls
    _tls_variables(monkeypatch, files)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"https://localhost:{port}")
    _send(_grpc(None))
    assert kept.arrived.wait(ARRIVAL_TIMEOUT_S)


def test_an_http_endpoint_and_a_bare_host_and_port_stay_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheme decides over the variable (as the specification says); a bare HOST:PORT with
    no variable is plaintext, as the setting always was."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "false")
    with collector() as (kept, port):
        _send(_grpc(f"http://127.0.0.1:{port}"), "scheme")
        assert kept.arrived.wait(ARRIVAL_TIMEOUT_S)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_INSECURE")
        kept.arrived.clear()
        _send(_grpc(f"127.0.0.1:{port}"), "bare")
        assert kept.arrived.wait(ARRIVAL_TIMEOUT_S)
    assert kept.names == ["scheme", "bare"]


def test_a_full_traces_url_is_posted_to_as_it_is() -> None:
    """A value as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT takes it: /v1/traces appended once more made
    /v1/traces/v1/traces, which the collector answered 404, and every span was dropped."""
    receiver = Receiver()
    try:
        for endpoint in (receiver.endpoint + "/v1/traces", receiver.endpoint + "/v1/traces/", receiver.endpoint):
            settings = TelemetrySettings(exporter="otlp_http", endpoint=endpoint, export_timeout_s=EXPORT_TIMEOUT_S)
            _send(settings, endpoint)
            receiver.wait_for(lambda spans, name=endpoint: any(s.name == name for s in spans), ARRIVAL_TIMEOUT_S)
    finally:
        receiver.close()


def test_an_endpoint_with_a_query_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="no query"):
        TelemetrySettings(exporter="otlp_http", endpoint="http://127.0.0.1:4318?tenant=a")


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A listener that never accepts: connections are made by the kernel, requests never answered."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"


def _timeout_given(settings: TelemetrySettings, monkeypatch: pytest.MonkeyPatch) -> float | None:
    """The timeout the service hands the OTLP/HTTP exporter it builds for ``settings``."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    given: list[float | None] = []

    class Recording(trace_exporter.OTLPSpanExporter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            given.append(kwargs.get("timeout"))
            super().__init__(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(trace_exporter, "OTLPSpanExporter", Recording)
        provider, _ = build_tracer_provider(settings)
    provider.shutdown()
    (timeout,) = given
    return timeout


def test_the_timeout_variables_apply_where_our_setting_is_unset(
    black_hole: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.3")
    unset = TelemetrySettings(exporter="otlp_http", endpoint=black_hole)
    assert export_timeout_s(unset) == 0.3, "the traces' own variable first"
    assert _timeout_given(unset, monkeypatch) == 0.3, "the exporter is given the variable's, not our default (5 s)"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
    assert export_timeout_s(unset) == 30
    ours = TelemetrySettings(exporter="otlp_http", endpoint=black_hole, export_timeout_s=0.3)
    assert export_timeout_s(ours) == 0.3
    assert _timeout_given(ours, monkeypatch) == 0.3, "our setting, set, wins over the variables"


@pytest.mark.parametrize("value", ["soon", "0", "10000"])
def test_a_timeout_variable_that_is_no_number_of_seconds_is_warned_of_and_ignored(
    value: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", value)
    with caplog.at_level(logging.WARNING, logger="app.telemetry.tracing"):
        assert export_timeout_s(TelemetrySettings(exporter="otlp_http")) == 5.0
    assert "OTEL_EXPORTER_OTLP_TIMEOUT" in caplog.text


def test_a_traces_timeout_variable_that_is_no_number_stops_the_grpc_exporter_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gRPC exporter parses OTEL_EXPORTER_OTLP_TRACES_TIMEOUT itself even when given a timeout:
    "5s" passed the warning, then failed the app's start with a traceback. It is refused with the
    settings, in one line; the HTTP exporter's is warned of and 5 s used, as above."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "5s")
    with pytest.raises(SettingsError, match=r"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='5s' is no number"):
        load_settings(telemetry={"exporter": "otlp_grpc", "endpoint": "http://127.0.0.1:4317"})
    assert load_settings(telemetry={"exporter": "otlp_http"}).telemetry.exporter == "otlp_http"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "7")
    settings = load_settings(telemetry={"exporter": "otlp_grpc", "endpoint": "http://127.0.0.1:4317"}).telemetry
    provider, processor = build_tracer_provider(settings)  # the exporter built: no ValueError
    assert processor is not None
    provider.shutdown()
