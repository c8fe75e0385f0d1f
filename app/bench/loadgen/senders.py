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


def _headers(urgent: bool, deadline_ms: float | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Urgency": "high" if urgent else "normal"}
    if deadline_ms is not None:
        headers["X-Request-Timeout"] = str(round(deadline_ms))
    return headers


def raw_sender(
    target: Target, path: str, bodies: Sequence[bytes], timeout: float, deadline_ms: float | None = None
) -> tuple[Send, rawhttp.Pool]:
    """A ``Send`` over a pool of raw keep-alive connections, every request's bytes built now."""
    requests = {
        (index, urgent): rawhttp.build_request("POST", target.authority, path, _headers(urgent, deadline_ms), body)
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
    client: httpx.AsyncClient, path: str, bodies: Sequence[bytes], timeout: float, deadline_ms: float | None = None
) -> Send:
    """A ``Send`` through httpx, each request bounded by ``timeout`` as a whole: httpx's own
    timeout bounds each read, and a server sending a byte now and then never trips it."""

    async def send(number: int, urgent: bool) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            response = await client.post(
                path, content=bodies[number % len(bodies)], headers=_headers(urgent, deadline_ms)
            )
        return response.status_code, response.content

    return send
