"""A request's path as the app's routes name it, wherever the app is mounted.

An ASGI server that serves the app under a prefix keeps the prefix in ``scope["path"]`` and
names it in ``scope["root_path"]``: uvicorn with ``--root-path``, Ray Serve for a deployment's
``route_prefix``. Starlette's router matches routes on the path with the prefix taken off;
everything that matches a request to a route before the router does (the prediction routes'
direct path, the edge, the admin gate, the probes left out of traces) must do the same.
"""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """``scope``'s path relative to the app's mount: ``root_path`` taken off where the path begins
    with it and a ``/`` (or nothing) follows, as Starlette's router takes it off; else the path as
    it came. Mounted at the root (no ``root_path``), the path itself, with no copy made."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    cut = len(root)
    if path.startswith("/", cut):
        return path[cut:]
    return "" if len(path) == cut else path  # "/tightly" is not under "/tight"
