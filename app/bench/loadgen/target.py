"""The service a run measures: the ``--url`` it is given, checked to be on loopback and listening."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Target:
    """The service, from ``--url``: the host and port the URL names (the ``Host`` header says
    them) and the loopback address every connection goes to, resolved once."""

    host: str
    port: int
    address: str

    @property
    def authority(self) -> str:
        """``host:port`` for the ``Host`` header."""
        return f"{_bracketed(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """The URL of the resolved address, for httpx (which would otherwise resolve the name again)."""
        return f"http://{_bracketed(self.address)}:{self.port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_url(url: str) -> tuple[str, int]:
    """The host and port of ``url``, an ``http://HOST[:PORT]`` URL; ``ValueError`` says what is wrong.
    User information is refused, not dropped: a run without the credentials it seemed to be given
    measures a service that answers 401 to everything."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number from 0 to 65535
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    if parts.username is not None or parts.password is not None:  # not echoed: it may hold a password
        raise ValueError(
            "holds user information (USER:PASSWORD@), which the load would not send; "
            "for a service with server.api_key set, give the key with --api-key-file"
        )
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// is supported")
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 cannot be connected to")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give the server only (http://HOST[:PORT]); the paths are the service's own")
    return parts.hostname, port or 80


def loopback_addresses(host: str) -> list[str]:
    """Every address ``host`` resolves to, all of them loopback ones, else ``ValueError``. A name
    is resolved, not trusted: ``/etc/hosts`` may send ``localhost`` off the machine."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{host} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    elsewhere = [a for a in addresses if not ipaddress.ip_address(a.partition("%")[0]).is_loopback]
    if elsewhere or not addresses:
        raise ValueError(f"{host} resolves to {', '.join(elsewhere or ['nothing'])}, not a loopback address")
    return addresses


def is_loopback(url: str) -> bool:
    """Whether every address ``url``'s host resolves to is a loopback one."""
    try:
        return bool(loopback_addresses(urlsplit(url).hostname or ""))
    except ValueError:
        return False


def reachable(addresses: Sequence[str], port: int, timeout_s: float = 5.0) -> tuple[str | None, str]:
    """The first of ``addresses`` where something listens on ``port``, or None and why not. Checked
    before a run: against a closed port every request fails at once, and the clients spin through
    tens of thousands of refused connections a second. ``localhost`` may resolve to ``::1`` and
    ``127.0.0.1`` with the server on one only: the run then sends to that one."""
    why = "no address"
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=timeout_s):
                return address, ""
        except OSError as exc:
            why = f"{exc.strerror or exc}"
    return None, why
