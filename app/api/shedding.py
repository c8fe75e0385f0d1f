"""Load shedding at the edge: a prediction the service would refuse now is refused first.

Under overload most requests must be refused, and a refusal that costs as much as an answer
turns overload into collapse: the event loop spends itself on refusals while the device
waits. So the edge asks the service's own admission rules (queue bounds, predicted wait
against the deadline, draining, not ready) before the body is read or parsed, and answers
their 503 in the usual envelope. The edge is the HTTP protocol itself under uvicorn
(``app.api.edge``), and the prediction routes' direct path in the outermost middleware
behind it (and under any other ASGI server). Everything it does not refuse, including
anything malformed, goes on to the route's handler, which decides as before; with an API
key configured it sheds nothing, so that credentials are checked first.
"""

from __future__ import annotations

import time

from fastapi.exceptions import RequestValidationError
from starlette.datastructures import State
from starlette.types import Scope

from app.api.body import check_declared_body
from app.api.deps import checked_top_k, predict_headers, query_top_k
from app.api.middleware import ARRIVED
from app.errors import ServiceError


def shed(state: State, scope: Scope, model: str | None) -> ServiceError | None:
    """The 503 the service would answer this prediction of ``model`` (None: the default) now,
    or None (the route decides). ``state`` is the app's."""
    service = getattr(state, "service", None)
    if service is None or getattr(state, "api_key", None) is not None:
        return None
    server = service.settings.server
    try:
        headers = predict_headers(scope, server)
        check_declared_body(scope, server.max_image_bytes, server.max_body_bytes)
        top_k = query_top_k(scope)
    except (ServiceError, RequestValidationError):
        # a bad header or query, a body no retry mends: the route answers the 4xx, with its message
        return None
    # the deadline runs from the request's first byte (the route's clock, or the protocol's): one
    # that passed on the way (a head that came slowly, a place far down a pipeline) is refused as
    # such. Otherwise the predicted wait is weighed against the whole deadline, so that the answer
    # (its message says the deadline) is the same from the edge and from the route
    since = scope["state"].get("started") or scope["state"].get(ARRIVED)
    remaining = headers.timeout_s - (time.perf_counter() - since) if since else headers.timeout_s
    try:
        served = service.served(model, headers.version)  # a canary's draw: made once, here
        scope["state"]["model"] = served  # for its server span, refused or not
        checked_top_k(top_k, server, len(served.labels))
        service.admit(served, headers.lane, remaining if remaining <= 0 else headers.timeout_s)
        scope["state"]["served"] = served  # the route serves the version this check was of
    except ServiceError as exc:
        if exc.status != 503:
            return None  # e.g. an unknown model: the route answers it
        # a refusal is a value from here on; its traceback would hold this call's frames, and the
        # caller's frame holding the refusal would close a reference cycle: at twice the load,
        # hundreds a second left for the cyclic collector, whose passes held the GIL 25 ms each
        return exc.with_traceback(None)
    return None
