"""What the requests send (the images, as JSON bodies) and the two clients that send them: raw
HTTP/1.1 bytes built up front, or httpx."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from pathlib import Path

import httpx

from app.bench import rawhttp
from app.bench.loadgen.loops import Send
from app.bench.loadgen.target import Target

IMAGE_SUFFIXES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}


def json_bodies(images: Sequence[bytes], top_k: int = 1) -> list[bytes]:
    """One JSON prediction body per image."""
    return [json.dumps({"image_base64": base64.b64encode(i).decode(), "top_k": top_k}).encode() for i in images]


def load_images(image: Path, folder: Path | None) -> list[bytes]:
    """Every image in ``folder`` (JPEG, PNG, WebP, by name), or the one ``image``."""
    if folder is None:
        return [image.read_bytes()]
    paths = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise FileNotFoundError(f"{folder} holds no .jpg, .jpeg, .png or .webp files")
    return [p.read_bytes() for p in paths]


def read_api_key(path: Path) -> str:
    """The API key in ``path`` (UTF-8, the whitespace around it dropped, as the service reads its
    ``server.api_key_file``), read once before a run; ``ValueError`` says why it cannot be sent."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    if not key:
        raise ValueError(f"{path} holds no key")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):  # a line break would end the header
        raise ValueError(f"{path} holds more than one line, or a control character")
    return key


def _headers(urgent: bool, deadline_ms: float | None = None, api_key: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Urgency": "high" if urgent else "normal"}
    if deadline_ms is not None:
        headers["X-Request-Timeout"] = str(round(deadline_ms))
    if api_key is not None:
        # the key's UTF-8 bytes, one character a byte: both clients write latin-1, and the
        # service compares the header's bytes with the bytes of its key
        headers["Authorization"] = "Bearer " + api_key.encode("utf-8").decode("latin-1")
    return headers


def raw_sender(
    target: Target,
    path: str,
    bodies: Sequence[bytes],
    timeout: float,
    deadline_ms: float | None = None,
    api_key: str | None = None,
) -> tuple[Send, rawhttp.Pool]:
    """A ``Send`` over a pool of raw keep-alive connections, every request's bytes built now."""
    requests = {
        (index, urgent): rawhttp.build_request(
            "POST", target.authority, path, _headers(urgent, deadline_ms, api_key), body
        )
        for index, body in enumerate(bodies)
        for urgent in (False, True)
    }
    pool = rawhttp.Pool(target.address, target.port)

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            head, body = await pool.request(requests[number % len(bodies), urgent])
        return head.status, body

    return send, pool


def httpx_sender(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[bytes],
    timeout: float,
    deadline_ms: float | None = None,
    api_key: str | None = None,
) -> Send:
    """A ``Send`` through httpx, each request bounded by ``timeout`` as a whole: httpx's own
    timeout bounds each read, and a server sending a byte now and then never trips it."""
    # built once, as latin-1 (httpx writes str header values as ASCII: a key past it would fail)
    headers = {
        urgent: httpx.Headers(_headers(urgent, deadline_ms, api_key), encoding="latin-1") for urgent in (False, True)
    }

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            response = await client.post(path, content=bodies[number % len(bodies)], headers=headers[urgent])
        return response.status_code, response.content

    return send
