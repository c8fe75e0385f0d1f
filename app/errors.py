"""The service's errors: each carries its HTTP status and a stable, machine-readable code.

Lower layers raise these (or have theirs translated at the boundary with ``raise ... from``);
one exception handler renders them all as the same envelope: code, message, request_id.
This module imports nothing heavy, so the batcher and the loader can use it freely.
"""

from __future__ import annotations

from collections.abc import Iterable

SHOWN_CHARS = 64  # of a client's string quoted back in a message (a name, a JSON key)
# the errors an answer lists: a body of thousands of unknown keys has as many, and listing them
# cost the event loop most of a second and made an answer several times the size of the body
MAX_LISTED_ERRORS = 10


def quoted(value: str) -> str:
    """``value`` as a message quotes it: its repr, cut to ``SHOWN_CHARS`` characters (an answer
    must not echo a megabyte the client sent)."""
    return repr(value) if len(value) <= SHOWN_CHARS else repr(value[:SHOWN_CHARS]) + "..."


def shown(part: str | int) -> str | int:
    """A place in a body (a key, an index), as an error names it: a key cut as ``quoted`` cuts it."""
    if isinstance(part, str) and len(part) > SHOWN_CHARS:
        return part[:SHOWN_CHARS] + "..."
    return part


def dotted(location: Iterable[str | int], whole: str) -> str:
    """A validation error's location as a message names it (``normal.max_batch``), each key cut as
    ``shown`` cuts it; ``whole`` when it is the whole thing."""
    return ".".join(str(shown(part)) for part in location) or whole


class ServiceError(Exception):
    """Base of every error the service knows how to answer."""

    status: int = 500
    code: str = "internal_error"
    retry_after_s: int | None = None
    headers: tuple[tuple[str, str], ...] = ()  # response headers its status calls for (RFC 9110, 7694)
    logged: bool = False  # its cause's traceback is in the log already (a batch's bug, once for its requests)

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class BadRequest(ServiceError):
    """The client sent something malformed (400)."""

    status = 400
    code = "bad_request"


class SchemaError(ServiceError):
    """The body parsed but violates the schema (422)."""

    status = 422
    code = "validation_error"


class PayloadTooLarge(ServiceError):
    """A body or an image over its limit, or a decompression bomb (413)."""

    status = 413
    code = "payload_too_large"


class LengthRequired(ServiceError):
    """A body without a declared length where its size is checked before it is read (411)."""

    status = 411
    code = "length_required"


class RequestTimeout(ServiceError):
    """The request did not arrive in time (408): its body, where no deadline of its own bounds it."""

    status = 408
    code = "request_timeout"


class UnsupportedMediaType(ServiceError):
    """A Content-Type the endpoint does not take (415)."""

    status = 415
    code = "unsupported_media_type"


class UnsupportedContentEncoding(UnsupportedMediaType):
    """A Content-Encoding the endpoint does not take (415, the codings it takes in ``Accept-Encoding``:
    RFC 7694, 3). A Transfer-Encoding is no content coding, and ``Accept-Encoding`` does not list
    those: its 415 is an ``UnsupportedMediaType``."""

    headers = (("Accept-Encoding", "identity"),)


class NotFound(ServiceError):
    """An unknown model, version or route (404)."""

    status = 404
    code = "not_found"


class Unavailable(ServiceError):
    """The service knows it cannot do this now (503 with Retry-After)."""

    status = 503
    code = "unavailable"
    retry_after_s = 1


class QueueFull(Unavailable):
    code = "queue_full"


class DeadlineExceeded(Unavailable):
    code = "deadline_exceeded"


class WouldMissDeadline(Unavailable):
    """Refused at admission: the queue ahead, at the measured batch latency, outlasts the deadline."""

    code = "would_miss_deadline"


class DeviceUnavailable(Unavailable):
    """The device keeps failing (e.g. out of memory at batch size 1) and no fallback is enabled."""

    code = "device_unavailable"
    retry_after_s = 5


class Draining(Unavailable):
    code = "draining"


class NotReady(Unavailable):
    code = "model_not_ready"
    retry_after_s = 5


class Unauthorized(ServiceError):
    """No credentials (401)."""

    status = 401
    code = "unauthorized"


class Forbidden(ServiceError):
    """Wrong credentials (403)."""

    status = 403
    code = "forbidden"


class BatchFailed(ServiceError):
    """The runner failed a batch for a reason nobody planned for: a bug (500, generic body)."""

    code = "inference_failed"


def fails_the_service(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the service's (a 5xx, or no service error at all: a bug),
    not the client's mistake (a 4xx): what marks a span failed, or counts against a batch."""
    return not isinstance(exc, ServiceError) or exc.status >= 500


def not_listed(count: int) -> str:
    """What a message says of the errors past ``MAX_LISTED_ERRORS`` ("" when all are listed)."""
    return f" ({count} errors, the first {MAX_LISTED_ERRORS} listed)" if count > MAX_LISTED_ERRORS else ""
