"""Prediction routes: the default model, or one by name.

FastAPI declares them (the OpenAPI document, and any path the edge does not take), but the
edge serves them itself, past the router: ``direct`` matches a prediction and runs the same
handler, with overload refused first and errors answered by the app's own exception
handlers. FastAPI's dispatch (its exception middleware, the router's scan, the endpoint
wrapper) cost 0.1-0.15 ms of the event loop's 0.68-0.76 per prediction at saturation.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from opentelemetry import trace
from starlette.types import ASGIApp, Receive, Scope, Send

from app.admission import Seat
from app.api.auth import check_api_key
from app.api.body import OPENAPI_BODY, check_declared_body, read_image_body
from app.api.deps import PredictHeaders, checked_top_k, predict_headers, query_top_k
from app.api.disconnect import ClientClosed, unless_disconnected
from app.api.errors import error_responses, service_error_response
from app.api.mount import route_path
from app.api.openapi import PREDICT_PARAMETERS
from app.api.schemas import PredictionItem, PredictResponse, Timings
from app.api.shedding import shed
from app.deadline import within
from app.errors import Draining, SchemaError
from app.prediction import Outcome
from app.routing import VersionNotLoaded
from app.service import InferenceService
from app.versions import ServedModel

router = APIRouter(tags=["predict"])

DEFAULT_PATH = "/predict"
NAMED_PATH = "/v1/models/{name}/predict"
_NAMED = re.compile(r"^/v1/models/([^/]+)/predict$")  # NAMED_PATH, matched as the router does

_ERRORS = error_responses(400, 401, 403, 404, 413, 415, 422, 500, 503)
_ERRORS[415] = {
    **_ERRORS[415],
    "description": "Content-Type not accepted, or the body sent with a Content-Encoding (send it unencoded) "
    "or a Transfer-Encoding other than chunked",
    "headers": {
        "Accept-Encoding": {
            "description": "`identity` when the refusal is for a Content-Encoding (RFC 7694); absent otherwise",
            "schema": {"type": "string", "enum": ["identity"]},
        }
    },
}
_ERRORS[422] = {
    **_ERRORS[422],
    "description": "The JSON body violates the schema, or top_k (query or body) is not a whole number from 1 "
    "to what the model answers, or the query and the body name two different ones",
}
_OPENAPI = {**OPENAPI_BODY, "parameters": PREDICT_PARAMETERS}


def _response(outcome: Outcome, request_id: str, started: float) -> PredictResponse:
    return PredictResponse(
        request_id=request_id,
        model=outcome.model,
        version=outcome.version,
        predictions=[PredictionItem(**vars(p)) for p in outcome.predictions],
        lane=outcome.lane.value,
        batch_size=outcome.batch_size,
        timings=Timings(
            preprocess=round(outcome.preprocess_s * 1000, 3),
            queue=round(outcome.queue_s * 1000, 3),
            inference=round(outcome.inference_s * 1000, 3),
            total=round((time.perf_counter() - started) * 1000, 3),
        ),
    )


def _seated_again(
    service: InferenceService,
    served: ServedModel,
    name: str | None,
    headers: PredictHeaders,
    remaining: float,
    refused: Draining,
) -> tuple[ServedModel, Seat]:
    """A request whose body came whole to a version that no longer takes it (``refused``): dropped
    when the close's grace ran out while its body arrived; else its version was unloaded
    (the service is not shutting down), and it is routed again, to what serves now, and counted
    there (a pinned version gone is 503 version_not_loaded)."""
    dropped = functools.partial(served.batcher.observer.on_dropped, headers.lane, "cancelled")
    if service.draining:
        dropped()
        raise refused
    try:
        again = service.served(name, headers.version)
    except VersionNotLoaded:
        dropped()
        raise VersionNotLoaded(
            f"version {served.version} of {served.name} was unloaded while this request's body arrived"
        ) from None
    return again, service.reserve(again, headers.lane, remaining)


async def _predict(name: str | None, request: Request) -> Response:
    service: InferenceService = request.app.state.service
    check_api_key(request)
    server = service.settings.server
    headers = predict_headers(request.scope, server)
    check_declared_body(request.scope, server.max_image_bytes, server.max_body_bytes)  # 415, 413: before any 503
    top_k_asked = query_top_k(request.scope)
    state = request.scope["state"]
    # the version the edge's check drew (a canary is drawn once a request), else drawn now:
    # 404 / 503 before reading the body
    served = state.pop("served", None)
    checked = served is not None  # the edge asked admission for it already
    if served is None:
        served = service.served(name, headers.version)
    state["model"] = served  # for its server span (the middleware's)
    checked_top_k(top_k_asked, server, len(served.labels))  # a 422 before any 503
    remaining = headers.timeout_s - (time.perf_counter() - state["started"])
    if not checked:
        service.admit(served, headers.lane, remaining)  # refused before the body is read: a refusal stays cheap
    # the body is read holding no seat in the lane: uploads that stall (or crawl) must not fill
    # the queue's bound or lengthen the wait predicted for others; admission is asked again
    # once the body is whole, and the seat taken then. A close waits for it, as for one queued
    expired = functools.partial(served.batcher.observer.on_dropped, headers.lane, "deadline")
    try:
        with served.batcher.intake.arriving():
            async with within(time.monotonic() + remaining, "while its body was arriving", expired):
                body = await read_image_body(request, server.max_image_bytes, server.max_body_bytes)
    except ClientClosed:  # admitted, and gone before its image was whole
        if "answered_as" not in state:  # not a body that broke, answered 400 by the protocol
            served.batcher.observer.on_dropped(headers.lane, "cancelled")
            trace.get_current_span().add_event("client went", {"while": "its body was arriving"})
        raise
    if body.top_k is not None and top_k_asked is not None and body.top_k != top_k_asked:
        # as a repeated header or query parameter: which one a server reads must not decide
        raise SchemaError(f"top_k is {top_k_asked} in the query and {body.top_k} in the body")
    asked = checked_top_k(body.top_k, server, len(served.labels)) or top_k_asked
    top_k = asked or min(server.default_top_k, server.max_top_k, len(served.labels))  # fewer classes: all
    remaining = headers.timeout_s - (time.perf_counter() - state["started"])
    try:
        seat = service.reserve(served, headers.lane, remaining, admitted=True)
    except Draining as refused:
        served, seat = _seated_again(service, served, name, headers, remaining, refused)
        state["model"] = served
    try:
        work = service.predict(served, body.payload, top_k, headers.lane, remaining, state["request_id"], seat)
        outcome = await unless_disconnected(request, work)
    finally:
        seat.release()
    response = _response(outcome, state["request_id"], state["started"])
    state["log_fields"] = {  # the access log line carries the stages
        "model": response.model,
        "version": response.version,
        "lane": response.lane,
        "batch_size": response.batch_size,
        "timings_ms": response.timings.model_dump(),
    }
    # serialised once, here: returning the model would make FastAPI validate it again first
    return Response(response.model_dump_json(), media_type="application/json")


@dataclass(frozen=True)
class PredictCall:
    """A request for one of the prediction routes: the model it names (None: the default)
    and the route's template (the latency metric's label)."""

    name: str | None
    template: str


_DEFAULT = PredictCall(None, DEFAULT_PATH)


def predict_call(scope: Scope) -> PredictCall | None:
    """The prediction this request asks for, matched as the router would; None for any other."""
    if scope["method"] != "POST":
        return None
    path = route_path(scope)  # under a mount's prefix too, as the router matches
    if path == DEFAULT_PATH:
        return _DEFAULT
    if match := _NAMED.fullmatch(path):
        return PredictCall(match[1], NAMED_PATH)
    return None


def direct(scope: Scope) -> ASGIApp | None:
    """The ASGI app that serves this request if it is a prediction, else None (route it)."""
    call = predict_call(scope)
    if call is None:
        return None
    scope["state"]["route"] = call.template  # the latency metric's label, as the router would set
    return functools.partial(_serve, call)


async def _serve(call: PredictCall, scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive, send)
    try:
        # refused before the body is read (unless the edge asked already); answered, not raised,
        # which would tie the refusal and this frame into a cycle through its traceback
        refusal = None if scope["state"].get("shed_checked") else shed(request.app.state, scope, call.name)
        if refusal is None:
            response = await _predict(call.name, request)
        else:
            response = await service_error_response(request, refusal)
    except Exception as exc:
        handlers = request.app.exception_handlers  # looked up by class, as Starlette does
        handler = next((handlers[klass] for klass in type(exc).__mro__ if klass in handlers), None)
        if handler is None:
            raise  # a bug: the middleware answers the generic 500
        response = await handler(request, exc)
    await response(scope, receive, send)


@router.post(
    DEFAULT_PATH,
    response_model=PredictResponse,
    responses=_ERRORS,
    openapi_extra=_OPENAPI,
    summary="Classify an image with the default model",
)
async def predict_default(request: Request) -> Response:
    """JSON `{"image_base64": ..., "top_k": 5}`, or the raw bytes with `Content-Type: image/jpeg|png|webp`."""
    return await _predict(None, request)


@router.post(
    NAMED_PATH,
    response_model=PredictResponse,
    responses=_ERRORS,
    openapi_extra=_OPENAPI,
    summary="Classify an image with the named model",
)
async def predict_named(
    name: Annotated[str, Path(description="a model name from GET /v1/models")], request: Request
) -> Response:
    """As `/predict`, for the model `name`; 404 when no such model is served."""
    return await _predict(name, request)
