"""The container's health check: ``python -m app.healthcheck`` asks the server's ``/livez``.

The address is the one the server listens on: ``ai-backend serve`` writes it, once listening, to
a file named by its process id in the temporary directory (``served_address_file``), and the
check reads that of process 1, the container's server (``--pid`` names another). Not the
settings as they read now: a ``server.port`` edited into the config file waits for a restart, and
an edit the service refused leaves it serving, while either would fail a check that read them.
Where no server wrote its address (one of another version), the settings' address is asked, read
as ``serve`` reads them. Exit status 0 when ``/livez`` answers 200, 1 otherwise (the reason on
stderr). The image has no curl or wget: Python's own HTTP client asks, past any proxy the
environment names.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 2.0  # under the HEALTHCHECK's --timeout
# a server bound to every address is asked on the loopback of the same family
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def livez_url(host: str, port: int) -> str:
    """The URL of ``/livez`` on a server bound to ``host`` and ``port``."""
    host = _LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}/livez" if ":" in host else f"http://{host}:{port}/livez"


def served_address_file(pid: int) -> Path:
    """Where the server of process ``pid`` writes the address it listens on (``HOST PORT``)."""
    return Path(tempfile.gettempdir()) / f"ai-backend-{pid}.address"


def write_served_address(host: str, port: int) -> None:
    """Blocking: this process's server listens on ``host`` and ``port`` (written whole, then
    renamed over the last, so that a check never reads half of it)."""
    path = served_address_file(os.getpid())
    partial = path.with_suffix(".partial")
    partial.write_text(f"{host} {port}\n")
    partial.replace(path)


def forget_served_address() -> None:
    """Blocking: this process's server has stopped listening."""
    with contextlib.suppress(OSError):
        served_address_file(os.getpid()).unlink()


def _served_address(pid: int) -> tuple[str, int] | None:
    try:
        host, port = served_address_file(pid).read_text().split()
        return host, int(port)
    except (OSError, ValueError):  # none written (another version's server), or not of ours
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, default=1, help="the server's process id (1: the container's)")
    args = parser.parse_args(argv)
    address = _served_address(args.pid)
    if address is None:  # imported only here: a check every 10 s reads the file alone
        from app.settings import SettingsError, load_settings

        try:
            server = load_settings().server
        except SettingsError as exc:
            print(f"healthcheck: {exc}", file=sys.stderr)
            return 1
        address = server.host, server.port
    url = livez_url(*address)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local: no proxy
    try:
        with opener.open(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except urllib.error.HTTPError as exc:  # a status other than 2xx
        status = exc.code
    except OSError as exc:  # refused, timed out, no such host
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
