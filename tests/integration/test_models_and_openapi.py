"""The model listing, unknown names (path tricks included) and the OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests import support
from tests.conftest import SettingsFactory
from tests.support import MODEL_NAME, RunningApp, build_settings, running_app, sample_png, top_label

pytestmark = pytest.mark.asyncio(loop_scope="module")

ERROR_REF = "#/components/schemas/ErrorResponse"
PREDICT_ERRORS = {"400", "404", "413", "415", "422", "500", "503"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def running() -> AsyncIterator[RunningApp]:
    async with running_app(build_settings()) as app:
        yield app


def _digits_entry(loaded_heads: list[str]) -> dict[str, object]:
    return {
        "name": MODEL_NAME,
        "versions": ["1"],
        "loaded_version": "1",
        "loaded_versions": ["1"],
        "previous_version": None,
        "canary": {},
        "state": "loaded",
        "default": True,
        "labels": 10,
        "device": "cpu",
        "dtype": "float32",
        "heads_loaded": loaded_heads,
    }


async def test_models_list_and_describe(running: RunningApp) -> None:
    assert running.service.repository.root == support.test_repository  # the session's private copy
    listing = await running.client.get("/v1/models")
    assert listing.status_code == 200
    body = listing.json()
    assert body["default"] == MODEL_NAME
    assert [m["name"] for m in body["models"]] == [MODEL_NAME]
    entry = body["models"][0]
    assert entry == _digits_entry(entry["heads_loaded"])
    one = await running.client.get(f"/v1/models/{MODEL_NAME}")
    assert one.status_code == 200
    assert one.json() == entry


async def test_the_head_loads_lazily_and_exactly_once(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings()) as running:
        served = running.service.models[MODEL_NAME]
        before = (await running.client.get(f"/v1/models/{MODEL_NAME}")).json()
        assert before["heads_loaded"] == []
        responses = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(10)))
        assert [top_label(r.json()) for r in responses] == [str(d) for d in range(10)]
        after = (await running.client.get(f"/v1/models/{MODEL_NAME}")).json()
        assert after == _digits_entry(["classifier"])
        assert served.model.head_loads == 1


async def test_eager_heads_load_before_ready(make_settings: SettingsFactory) -> None:
    async with running_app(make_settings(model={"eager_heads": True})) as running:
        described = (await running.client.get(f"/v1/models/{MODEL_NAME}")).json()
        assert described == _digits_entry(["classifier"])


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/v1/models/nope", "model_not_found"),
        ("/v1/models/DIGITS", "model_not_found"),
        ("/v1/models/digits%20", "model_not_found"),
        ("/v1/models/%2E%2E", "model_not_found"),
        ("/v1/models/..%2F..%2Fetc", None),
        ("/v1/models/..%2F..%2Fetc%2Fpasswd", None),
        ("/v1/models/digits%2F1", None),
        ("/v1/models/digits/1", None),
        ("/v1/models/%00", "model_not_found"),
    ],
)
async def test_unknown_models_are_404(running: RunningApp, path: str, code: str | None) -> None:
    response = await running.client.get(path, headers={"X-Request-ID": "lookup"})
    assert response.status_code == 404, response.text
    body = response.json()
    assert body["request_id"] == "lookup"
    # a path that no route matches is a plain not_found; a name that matches the route is an unknown model
    assert body["code"] == (code or "not_found")
    assert "root:" not in response.text and "passwd" not in body["message"].replace(path, "")


@pytest.mark.parametrize("name", ["nope", "%2E%2E", "..%2F..%2Fetc", "..%2F..%2Fmodels%2Fdigits", "digits%2F1"])
async def test_predict_on_unknown_models_is_404(running: RunningApp, name: str) -> None:
    response = await running.predict_png(sample_png(1), path=f"/v1/models/{name}/predict")
    assert response.status_code == 404, response.text
    assert response.json()["code"] in {"model_not_found", "not_found"}


async def test_openapi_lists_every_endpoint_with_its_errors(running: RunningApp) -> None:
    response = await running.client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    paths = spec["paths"]
    expected = {
        "/predict": {"post"},
        "/v1/models/{name}/predict": {"post"},
        "/v1/models": {"get"},
        "/v1/models/{name}": {"get"},
        "/livez": {"get"},
        "/readyz": {"get"},
        "/healthz": {"get"},
        "/metrics": {"get"},
    }
    assert {path: set(ops) for path, ops in paths.items()} == expected

    for path in ("/predict", "/v1/models/{name}/predict"):
        operation = paths[path]["post"]
        responses = operation["responses"]
        assert set(responses) >= PREDICT_ERRORS, (path, sorted(responses))
        for status in PREDICT_ERRORS:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": ERROR_REF}, (path, status, schema)
            assert responses[status]["description"]
        ok = responses["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": "#/components/schemas/PredictResponse"}
        content = operation["requestBody"]["content"]
        assert set(content) == {"application/json", "image/jpeg", "image/png", "image/webp"}
        assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/PredictRequest"}
        params = {(p["name"].lower(), p["in"]) for p in operation["parameters"]}
        assert {("x-urgency", "header"), ("x-request-timeout", "header"), ("top_k", "query")} <= params

    assert paths["/readyz"]["get"]["responses"]["503"]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
    assert paths["/v1/models/{name}"]["get"]["responses"]["404"]["content"]["application/json"]["schema"] == {
        "$ref": ERROR_REF
    }
    healthz_503 = paths["/healthz"]["get"]["responses"]["503"]["content"]["application/json"]["schema"]
    assert healthz_503 == {"$ref": "#/components/schemas/HealthResponse"}

    schemas = spec["components"]["schemas"]
    assert set(schemas["ErrorResponse"]["required"]) == {"code", "message", "request_id"}
    assert {"PredictResponse", "ModelsResponse", "ModelVersion", "HealthResponse"} <= set(schemas)


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


async def test_every_openapi_reference_resolves(running: RunningApp) -> None:
    spec = (await running.client.get("/openapi.json")).json()
    defined = {f"#/components/schemas/{name}" for name in spec["components"]["schemas"]}
    assert _refs(spec) <= defined, sorted(_refs(spec) - defined)


async def test_every_documented_error_is_the_envelope(running: RunningApp) -> None:
    spec = (await running.client.get("/openapi.json")).json()
    checked = 0
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and (path, status) != ("/healthz", "503"):  # its 503 is the health body
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": ERROR_REF}, (method, path, status, schema)
                    checked += status == "422"
    assert checked == 2, "the predict routes document their 422 (the model's page has none to answer)"


async def test_the_shipped_config_serves_a_repository_without_the_bundled_model(tmp_path: Path) -> None:
    # config/default.toml must not name a model: a repository of other models starts on it
    target = tmp_path / "mnist" / "1"
    shutil.copytree(support.MODELS_DIR / "digits" / "1", target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["name"] = "mnist"
    (target / "manifest.json").write_text(json.dumps(manifest))
    async with running_app(build_settings(model={"repository": tmp_path})) as running:
        assert running.service.default_model == "mnist"
        answer = await running.predict_png(sample_png(7))
        assert answer.status_code == 200 and answer.json()["model"] == "mnist"


async def test_head_is_answered_wherever_get_is(make_settings: SettingsFactory) -> None:
    """RFC 9110, 9.1: a general-purpose server supports HEAD wherever GET is; these were 405."""
    token = "s3cret-admin-token-0123456789"
    settings = make_settings(admin={"enabled": True, "token": token, "config_watch_s": 0})
    auth = {"Authorization": f"Bearer {token}"}
    async with running_app(settings) as running:
        for path, headers in (("/v1/models", {}), (f"/v1/models/{MODEL_NAME}", {}), ("/admin/policy", auth)):
            got = await running.client.get(path, headers=headers)
            head = await running.client.head(path, headers=headers)
            assert head.status_code == got.status_code == 200 and head.content == b"", path
            assert head.headers["content-length"] == got.headers["content-length"], path
        assert (await running.client.head("/admin/policy")).status_code == 401, "as guarded as GET"
        assert (await running.client.head("/v1/models/nope")).status_code == 404


async def test_the_document_declares_the_credentials_bounds_and_headers_the_server_has(
    make_settings: SettingsFactory,
) -> None:
    """A client generated from the document could not log in: the token was an ``Authorization``
    header parameter (which OpenAPI 3.1 ignores), optional, where the server requires it; and it
    knew no Retry-After to back off with, no bound on the deadline, no lanes' names."""
    token = "s3cret-admin-token-0123456789"
    for keyed in (False, True):
        server = {"api_key": "a-prediction-api-key-0123456789"} if keyed else {}
        settings = make_settings(admin={"enabled": True, "token": token, "config_watch_s": 0}, server=server)
        async with running_app(settings) as running:
            headers = {"Authorization": "Bearer a-prediction-api-key-0123456789"} if keyed else {}
            document = (await running.client.get("/openapi.json", headers=headers)).json()
        assert set(document["components"]["securitySchemes"]) == {"adminToken", "apiKey"}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                names = {p["name"].lower() for p in operation.get("parameters", [])}
                assert "authorization" not in names, (path, method)
                for status, response in operation["responses"].items():
                    assert "X-Request-ID" in response["headers"], (path, method, status)
                    assert ("Retry-After" in response["headers"]) == (status == "503"), (path, method, status)
                if path.startswith("/admin"):
                    assert operation["security"] == [{"adminToken": []}], (path, method)
        predict = document["paths"]["/predict"]["post"]
        assert predict.get("security") == ([{"apiKey": []}] if keyed else None)
        params = {p["name"]: p["schema"] for p in predict["parameters"]}
        assert params["X-Urgency"]["enum"] == ["high", "normal"]
        assert params["X-Request-Timeout"]["maximum"] == settings.server.max_timeout_ms
        assert "X-Request-ID" in params
        assert set(document["paths"]["/admin/policy"]["put"]["responses"]) >= {"400", "411", "413", "415"}


async def test_the_documents_error_details_and_metrics_are_typed(running: RunningApp) -> None:
    document = (await running.client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    detail = schemas["ErrorDetail"]
    assert set(detail["required"]) == {"loc", "msg", "type"}
    assert schemas["ErrorResponse"]["properties"]["details"]["anyOf"][0]["items"] == {
        "$ref": "#/components/schemas/ErrorDetail"
    }
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    refused = await running.predict_png(sample_png(1), params={"top_k": "x"})
    assert refused.status_code == 422
    (listed,) = refused.json()["details"]
    assert set(listed) == {"loc", "msg", "type"} and listed["loc"] == ["query", "top_k"], listed
