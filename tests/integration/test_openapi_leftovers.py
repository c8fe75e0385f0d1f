"""OpenAPI gaps a review found, reading the document as an SDK generator would, each checked
against the server's real answers: a 405 the document explained nowhere, a 500 declared only on
the predictions, 422s declared where no request can get one, ``top_k``'s default read as null
(the server's is ``server.default_top_k``) and its strictness unsaid, and a Content-Encoding's
415 without its ``Accept-Encoding`` header.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from app.api.routes import models as models_route
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, RunningApp, build_settings, running_app, sample_png

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "s3cret-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
PNG = sample_png(1)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def running() -> AsyncIterator[RunningApp]:
    settings = build_settings(admin={"enabled": True, "token": TOKEN, "config_watch_s": 0})
    async with running_app(settings) as app:
        yield app


async def _document(running: RunningApp) -> dict[str, Any]:
    response = await running.client.get("/openapi.json")
    assert response.status_code == 200
    document: dict[str, Any] = response.json()
    return document


def _concrete(path: str) -> str:
    return path.replace("{name}", MODEL_NAME).replace("{version}", "1")


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]


async def test_no_operation_declares_a_405_and_the_document_says_what_a_wrong_method_gets(
    running: RunningApp,
) -> None:
    """A 405 answers a method a path lacks, which no operation of the path can answer: the
    document says so once (its description), and each path's operations are what ``Allow`` lists."""
    document = await _document(running)
    for path, method, operation in _operations(document):
        assert "405" not in operation["responses"], (path, method)
    description = document["info"]["description"]
    assert "405" in description and "`method_not_allowed`" in description and "`Allow`" in description
    for path, operations in document["paths"].items():
        wrong = await running.client.request("PATCH", _concrete(path), headers=AUTH)
        assert wrong.status_code == 405, (path, wrong.text)
        assert wrong.json()["code"] == "method_not_allowed"
        documented = {method.upper() for method in operations}
        allowed = {method.strip() for method in wrong.headers["allow"].split(",")}
        assert allowed == documented | ({"HEAD"} if "GET" in documented else set()), path


async def test_every_operation_declares_the_500_envelope(
    running: RunningApp, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    document = await _document(running)
    for path, method, operation in _operations(document):
        internal = operation["responses"].get("500")
        assert internal is not None, (path, method)
        assert internal["content"]["application/json"]["schema"] == ERROR_REF, (path, method)
        assert internal["description"] and "X-Request-ID" in internal["headers"], (path, method)
    assert "500" in document["paths"]["/livez"]["get"]["responses"]

    def broken(service: object) -> object:
        raise RuntimeError("a bug in the listing")

    monkeypatch.setattr(models_route, "_describe", broken)  # a route that is not a prediction
    answer = await running.client.get("/v1/models", headers={"X-Request-ID": "bug-listing"})
    assert answer.status_code == 500
    assert answer.json() == {"code": "internal_error", "message": "internal server error", "request_id": "bug-listing"}
    assert any(r.exc_info and "a bug in the listing" in str(r.exc_info[1]) for r in caplog.records)


# (method, path, what a request that should not validate sends): none of them is a 422
NO_422 = [
    ("get", "/v1/models/{name}", "/v1/models/%FF%00?name=1&x=%FF"),
    ("get", "/admin/policy", "/admin/policy?window_ms=-1"),
    ("post", "/admin/models/{name}/versions/{version}/load", f"/admin/models/{MODEL_NAME}/versions/1/load?force=x"),
    ("post", "/admin/models/{name}/versions/{version}/unload", f"/admin/models/{MODEL_NAME}/versions/1/unload?x=1"),
    ("post", "/admin/models/{name}/rollback", f"/admin/models/{MODEL_NAME}/rollback?to=x"),
]


@pytest.mark.parametrize(("method", "template", "target"), NO_422, ids=[t for _, t, _ in NO_422])
async def test_no_422_is_declared_where_the_server_answers_none(
    running: RunningApp, method: str, template: str, target: str
) -> None:
    document = await _document(running)
    assert "422" not in document["paths"][template][method]["responses"], template
    for body in (None, b'{"weights": "x", "top_k": 0}', b"not json", b"[]"):
        headers = {**AUTH, "Content-Type": "application/json"} if body is not None else AUTH
        answer = await running.client.request(method.upper(), target, headers=headers, content=body)
        assert answer.status_code != 422, (target, body, answer.text)
    long_name = await running.client.request(method.upper(), _concrete(template).replace(MODEL_NAME, "x" * 300))
    assert long_name.status_code != 422


async def test_422_is_declared_where_the_server_answers_one_as_the_envelope(running: RunningApp) -> None:
    document = await _document(running)
    declared = {(path, method) for path, method, op in _operations(document) if "422" in op["responses"]}
    assert declared == {
        ("/predict", "post"),
        ("/v1/models/{name}/predict", "post"),
        ("/admin/policy", "put"),
        ("/admin/policy/reload", "post"),  # an invalid config file (tests/integration/test_policy.py)
        ("/admin/models/{name}/versions/{version}/promote", "post"),
        ("/admin/models/{name}/canary", "put"),
    }
    for path, method in declared:
        schema = document["paths"][path][method]["responses"]["422"]["content"]["application/json"]["schema"]
        assert schema == ERROR_REF, (path, method)
    assert not {"HTTPValidationError", "ValidationError"} & set(document["components"]["schemas"])
    admin = {**AUTH, "Content-Type": "application/json"}
    refused = [
        await running.predict_png(PNG, params={"top_k": "0"}),
        await running.predict_png(PNG, path=f"/v1/models/{MODEL_NAME}/predict", params={"top_k": "x"}),
        await running.client.put("/admin/policy", headers=admin, content=b'{"normal": {"window_ms": -1}}'),
        await running.client.post(f"/admin/models/{MODEL_NAME}/versions/1/promote?force=maybe", headers=AUTH),
        await running.client.put(f"/admin/models/{MODEL_NAME}/canary", headers=admin, content=b'{"weights": 1}'),
    ]
    for answer in refused:
        assert answer.status_code == 422, answer.text
        assert answer.json()["code"] == "validation_error"


async def test_the_canary_declares_its_bodys_refusals(running: RunningApp) -> None:
    """The admin gate's 411 and 413 and a body that is not JSON (400), as PUT /admin/policy declares them."""
    document = await _document(running)
    assert set(document["paths"]["/admin/models/{name}/canary"]["put"]["responses"]) >= {"400", "411", "413", "415"}
    path = f"/admin/models/{MODEL_NAME}/canary"
    admin = {**AUTH, "Content-Type": "application/json"}

    async def chunked() -> AsyncIterator[bytes]:
        yield b'{"weights": {}}'

    answers = {
        400: await running.client.put(path, headers=admin, content=b"{not json"),
        411: await running.client.put(path, headers=admin, content=chunked()),
        413: await running.client.put(path, headers=admin, content=b" " * (1 << 20)),
        415: await running.client.put(path, headers={**AUTH, "Content-Type": "text/plain"}, content=b"{}"),
    }
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)


async def test_top_k_s_default_is_the_configured_one_and_its_strictness_is_said(
    make_settings: SettingsFactory,
) -> None:
    """pydantic's default (null) is not the server's; the configured one is, here 3 (not the shipped 5)."""
    async with running_app(make_settings(server={"default_top_k": 3})) as running:
        document = await _document(running)
        body_top_k = document["components"]["schemas"]["PredictRequest"]["properties"]["top_k"]
        assert body_top_k["default"] == 3
        assert "3.0" in body_top_k["description"] and "422" in body_top_k["description"]
        for path in ("/predict", "/v1/models/{name}/predict"):
            (query,) = [p for p in document["paths"][path]["post"]["parameters"] if p["name"] == "top_k"]
            assert query["schema"]["default"] == 3, path
            assert "3.0" in query["description"], path
        # what the server does: absent or null is the default; a number with a fraction or an
        # exponent is refused, in the query and in the body
        unnamed = await running.predict_png(PNG)
        assert len(unnamed.json()["predictions"]) == 3
        image = base64.b64encode(PNG).decode()
        json_type = {"Content-Type": "application/json"}
        for top_k in ("null", "2"):
            named = await running.client.post(
                "/predict", headers=json_type, content=f'{{"image_base64": "{image}", "top_k": {top_k}}}'.encode()
            )
            assert len(named.json()["predictions"]) == (3 if top_k == "null" else 2), top_k
        for top_k in ("3.0", "3e0", "true", '"3"'):
            refused = await running.client.post(
                "/predict", headers=json_type, content=f'{{"image_base64": "{image}", "top_k": {top_k}}}'.encode()
            )
            assert refused.status_code == 422, (top_k, refused.text)
        for top_k in ("3.0", "3e0", "+3"):
            assert (await running.predict_png(PNG, params={"top_k": top_k})).status_code == 422, top_k


async def test_a_content_encodings_415_declares_accept_encoding(running: RunningApp) -> None:
    document = await _document(running)
    for path in ("/predict", "/v1/models/{name}/predict"):
        unsupported = document["paths"][path]["post"]["responses"]["415"]
        header = unsupported["headers"]["Accept-Encoding"]
        assert header["schema"] == {"type": "string", "enum": ["identity"]}, path
        assert "Content-Encoding" in unsupported["description"], path
        assert {"X-Request-ID", "X-Trace-Id"} <= set(unsupported["headers"]), "the common headers stay"
    encoded = await running.predict_png(PNG, headers={"Content-Encoding": "gzip"})
    assert encoded.status_code == 415 and encoded.headers["accept-encoding"] == "identity"
    mistyped = await running.predict_png(PNG, headers={"Content-Type": "text/plain"})
    assert mistyped.status_code == 415 and "accept-encoding" not in mistyped.headers
    assert json.loads(encoded.text)["code"] == "unsupported_media_type"
