"""The container's health check: ``python -m app.healthcheck`` asks the server's ``/livez``.

The address is the one the settings give the server, read as ``ai-backend serve`` reads them
(the environment, then the config file), so ``AI_SERVICE_SERVER__PORT`` or the file's
``server.port`` is followed; a port given only on the command line (``serve --port``) is not.
Exit status 0 when ``/livez`` answers 200, 1 otherwise (the reason on stderr). The image has no
curl or wget: Python's own HTTP client asks, past any proxy the environment names.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from app.settings import SettingsError, load_settings

TIMEOUT_S = 2.0  # under the HEALTHCHECK's --timeout
# a server bound to every address is asked on the loopback of the same family
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def livez_url(host: str, port: int) -> str:
    """The URL of ``/livez`` on a server bound to ``host`` and ``port``."""
    host = _LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}/livez" if ":" in host else f"http://{host}:{port}/livez"


def main() -> int:
    try:
        server = load_settings().server
    except SettingsError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    url = livez_url(server.host, server.port)
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
