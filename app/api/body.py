"""Reading a prediction body: size-limited while it streams in, JSON or raw image bytes."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Scope

from app.api.disconnect import ClientClosed
from app.api.schemas import PredictRequest
from app.errors import (
    MAX_LISTED_ERRORS,
    BadRequest,
    PayloadTooLarge,
    SchemaError,
    ServiceError,
    UnsupportedContentEncoding,
    UnsupportedMediaType,
    dotted,
)
from app.inference.encoded import base64_bytes
from app.inference.preprocess import ACCEPTED_FORMATS

IMAGE_TYPES = frozenset(ACCEPTED_FORMATS.values())
JSON_TYPE = "application/json"

# The body is read by hand (JSON or raw image bytes), so FastAPI cannot see its model:
# the route declares both media types, and ``extra_openapi_schemas`` defines the JSON one.
OPENAPI_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            JSON_TYPE: {"schema": {"$ref": "#/components/schemas/PredictRequest"}},
            **{kind: {"schema": {"type": "string", "format": "binary"}} for kind in sorted(IMAGE_TYPES)},
        },
    }
}


@dataclass(frozen=True)
class ImageBody:
    """A prediction body: raw image bytes, or (from JSON) the image still base64-encoded.

    ``payload`` is what the decode pool takes (``preprocess.decode_payload`` takes either), so
    base64 is decoded off the event loop; ``image`` decodes it here, for callers that want bytes.
    """

    payload: bytes | str
    top_k: int | None

    @property
    def image(self) -> bytes:
        return self.payload if isinstance(self.payload, bytes) else base64_bytes(self.payload)


async def read_limited(request: Request, limit: int, code: str = "body_too_large") -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body is {declared} bytes; the limit is {limit}", code=code)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body is over the limit of {limit} bytes", code=code)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientClosed("the client disconnected while sending its body") from None
    return b"".join(chunks)  # one copy at most (none for a body that came in one piece)


def _body_error(exc: ValidationError) -> ServiceError:
    """400 for JSON that does not parse, else 422 naming what is wrong. A body of thousands
    of unknown keys has as many errors: listing them cost the event loop most of a second,
    and the answer was larger than the body, so only a few are listed."""
    count = exc.error_count()
    if count > MAX_LISTED_ERRORS:  # not malformed JSON: that is one error
        return SchemaError(f"the body has {count} schema errors; it takes image_base64 and, optionally, top_k")
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if any(error["type"] == "json_invalid" for error in errors):
        return BadRequest("the body is not valid JSON", code="invalid_json")
    return SchemaError("; ".join(f"{dotted(e['loc'], 'body')}: {e['msg']}" for e in errors))


def media_type(value: str) -> str:
    """A Content-Type's media type, without its parameters."""
    return value.split(";", 1)[0].strip().lower()


def body_limit(content_type: str, max_image_bytes: int, max_json_bytes: int) -> tuple[int, str]:
    """The size limit of a body of this media type and the code past it; 415 for a type not taken."""
    if content_type == JSON_TYPE:
        return max_json_bytes, "body_too_large"
    if content_type in IMAGE_TYPES:
        return max_image_bytes, "image_too_large"
    raise UnsupportedMediaType(
        f"Content-Type must be {JSON_TYPE} or one of {', '.join(sorted(IMAGE_TYPES))}; got {content_type or 'none'}"
    )


def check_declared_body(scope: Scope, max_image_bytes: int, max_json_bytes: int) -> None:
    """What a prediction's headers alone say is wrong with its body, before it is admitted or
    read: a Content-Type, a Content-Encoding or a Transfer-Encoding not taken (415), a declared
    Content-Length past its limit (413) or of 0 (400). No retry mends these, so none may hide
    behind a 503 with a Retry-After."""
    content_type: str | None = None
    length: str | None = None
    for key, value in scope["headers"]:
        if key == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif key == b"content-length" and length is None:
            length = value.decode("latin-1")
        elif key == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            # a gzipped body read as it came would fail as bad JSON or a bad image: say why (RFC 9110, 8.4.1)
            raise UnsupportedContentEncoding(
                f"Content-Encoding {value.decode('latin-1').strip()} is not taken: send the body unencoded"
            )
        elif key == b"transfer-encoding" and value.strip().lower() != b"chunked":
            # the HTTP parser undoes chunked alone: a gzip coding before it would reach us still gzipped
            # (RFC 9112, 6.1 answers a coding not understood with a 501: the service answers no 5xx
            # for a client's request, and a 415 says as well what to change)
            raise UnsupportedMediaType(
                f"Transfer-Encoding {value.decode('latin-1').strip()} is not taken: only chunked is"
            )
    kind = media_type(content_type or "")
    limit, code = body_limit(kind, max_image_bytes, max_json_bytes)
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"body is {length} bytes; the limit is {limit}", code=code)
    if length is not None and length.isdigit() and int(length) == 0:
        image_body(kind, b"", max_image_bytes)  # an empty body: the 400 that reading it would give


async def read_image_body(request: Request, max_image_bytes: int, max_json_bytes: int) -> ImageBody:
    """The image (and top_k) from a JSON body or from raw image bytes, by Content-Type."""
    content_type = media_type(request.headers.get("content-type", ""))
    limit, code = body_limit(content_type, max_image_bytes, max_json_bytes)
    return image_body(content_type, await read_limited(request, limit, code), max_image_bytes)


def image_body(content_type: str, raw: bytes, max_image_bytes: int) -> ImageBody:
    """The image (and top_k) in a body of ``content_type`` read whole (400 for an empty one)."""
    if content_type != JSON_TYPE:
        if not raw:
            raise BadRequest("the body is empty", code="empty_body")
        return ImageBody(raw, None)  # top_k comes from the query string
    try:
        parsed = PredictRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _body_error(exc) from exc
    text = parsed.image_base64
    decoded_size = len(text) // 4 * 3 - text.count("=", -2)  # exact for valid base64
    if decoded_size > max_image_bytes:
        # Past the limit, the text is decoded to tell: the size is only right for valid base64, and
        # line-wrapped base64 of an image under the limit looked over it (a 413 asking for a smaller
        # image, where the mend is to drop the line breaks: the 400 that says so answers instead).
        # SIMD, about 0.1 ms a megabyte, and only for a body already refused; what is wrong with an
        # invalid text is told from a bounded part of it (``base64_mistake``), whatever its length.
        decoded_size = len(base64_bytes(text))
        if decoded_size > max_image_bytes:
            raise PayloadTooLarge(
                f"image is {decoded_size} bytes; the limit is {max_image_bytes}", code="image_too_large"
            )
    return ImageBody(text, parsed.top_k)
