"""The ``AI_SERVICE_*`` variables that no setting reads, named in a warning at start-up.

pydantic-settings ignores a variable whose first name matches no group of settings: a single
``_`` where ``__`` goes (``AI_SERVICE_SERVER_PORT``), an unknown group, ``AI_SERVICE_CONFIG``
for ``AI_SERVICE_CONFIG_FILE``; the typo changed nothing, and nothing said so. (One inside a
known group, ``AI_SERVICE_SERVER__PROT``, is refused at start-up.) These are not refused:
Kubernetes gives every pod the service links of the Services in its namespace, and those of a
Service named ``ai-service`` begin with ``AI_SERVICE_`` as well.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Iterator, Mapping

from pydantic import BaseModel

from app.settings import CONFIG_FILE_ENV, ENV_PREFIX, Settings, env_name

log = logging.getLogger(__name__)

# Kubernetes' service links of a Service NAME (upper case, "-" as "_"): NAME_SERVICE_HOST,
# NAME_SERVICE_PORT[_<port name>], NAME_PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR], and NAME_PORT,
# told from a typo such as AI_SERVICE_SERVER_PORT=8080 by its value, a URL (tcp://10.0.0.1:80).
# A Service named "ai" links AI_SERVICE_HOST and AI_SERVICE_PORT (plain values): left out too
_SERVICE_LINK = re.compile(r"_SERVICE_HOST$|_SERVICE_PORT(_\w+)?$|_PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?$")
_SERVICE_URL = re.compile(r"(tcp|udp|sctp)://", re.IGNORECASE)


def _names(model: type[BaseModel], location: tuple[str, ...] = ()) -> Iterator[str]:
    """The variable of every setting and group under ``model``, less the prefix."""
    for name, field in model.model_fields.items():
        here = (*location, name)
        yield env_name(here)[len(ENV_PREFIX) :]
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _names(field.annotation, here)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``AI_SERVICE_*`` variables that no setting reads, each with the nearest one that
    does when one is close, e.g. ``AI_SERVICE_SERVER_PORT (AI_SERVICE_SERVER__PORT?)``;
    Kubernetes' service links left out. Names only: a value may be a secret."""
    known = [*_names(Settings), CONFIG_FILE_ENV[len(ENV_PREFIX) :]]
    found = []
    for name, value in sorted(environ.items()):
        upper = name.upper()  # pydantic-settings reads ai_service_server__port too
        if not upper.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        rest = upper[len(ENV_PREFIX) :]
        if rest.split("__")[0].lower() in Settings.model_fields:
            continue  # read, or refused at start-up if nothing in its group is called so
        if _SERVICE_LINK.search(upper) or (upper.endswith("_PORT") and _SERVICE_URL.match(value)):
            continue
        nearest = difflib.get_close_matches(rest, known, n=1)
        found.append(f"{name} ({ENV_PREFIX}{nearest[0]}?)" if nearest else name)
    return found


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> None:
    """One warning naming the ``AI_SERVICE_*`` variables that no setting reads, if any."""
    unknown = unknown_variables(environ)
    if unknown:
        log.warning("%s* variables that match no setting are ignored: %s", ENV_PREFIX, ", ".join(unknown))
