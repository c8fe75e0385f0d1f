"""Settings built from their sources (``load_settings``, ``read_settings``), and a failure turned
into one ``SettingsError`` that names each refused setting and where its value came from: its
environment variable, its group's, or the config file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError as EnvironmentValueError

from app.errors import dotted
from app.settings.groups import Settings
from app.settings.sources import CONFIG_FILE_ENV, ENV_PREFIX, SettingsError, config_path, env_name


def setting_location(location: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """The part of a validation error's location that names a setting: the keys and indices
    after it are inside that setting's value (``model.versions.digits.0`` is an entry of
    ``AI_SERVICE_MODEL__VERSIONS``'s JSON, not a variable of its own)."""
    model: type[BaseModel] | None = Settings
    for length, part in enumerate(location):
        if model is None:
            return location[:length]
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:  # a name the group does not have (``server.prot``): the variable that set it
            return location[: length + 1]
        annotation = field.annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return location


def _source(location: tuple[int | str, ...], overrides: Mapping[str, object]) -> str:
    """Where a refused setting came from, for its message: the variable that holds it (its own, or
    its group's JSON), as it is spelled (pydantic-settings reads their names in any case); for a
    rule over several settings (a group's, or one across groups), the variables set under it; or
    the config file when no variable of its has a say and it was not given in code (``serve
    --port``, Ray's builder arguments: then its variable's name, as before)."""
    setting = setting_location(location)
    spelled = {name.upper(): name for name in os.environ if name.upper() != CONFIG_FILE_ENV}
    names = [env_name(setting[:length]) for length in range(len(setting), 0, -1)]
    if held := next((spelled[name] for name in names if name in spelled), None):
        return held
    below = names[0] + "__" if names else ENV_PREFIX
    if under := sorted(spelled[name] for name in spelled if name.startswith(below)):
        return ", ".join(under)
    if setting and setting[0] in overrides:
        return names[0]
    return f"config file {config_path()}"


def _unparsable_variables(environ: Mapping[str, str]) -> list[str]:
    """The ``AI_SERVICE_*`` variables of list or table settings whose values are not JSON
    (pydantic-settings names only the group, not the variable)."""
    found = []
    for name, value in sorted(environ.items()):
        upper = name.upper()  # read in any case
        if not upper.startswith(ENV_PREFIX) or upper == CONFIG_FILE_ENV:
            continue
        model: type[BaseModel] | None = Settings
        annotation: Any = None
        for part in upper[len(ENV_PREFIX) :].lower().split("__"):
            field = model.model_fields.get(part) if model is not None else None
            if field is None:
                annotation = None
                break
            annotation = field.annotation
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if annotation is None or not _is_complex(annotation):
            continue
        try:
            json.loads(value)
        except ValueError:
            found.append(name)
    return found


def _is_complex(annotation: Any) -> bool:
    """A list, tuple, set, dict or model: what pydantic-settings reads from the environment as JSON."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        return any(_is_complex(arg) for arg in get_args(annotation) if arg is not type(None))
    kind = origin or annotation
    return isinstance(kind, type) and (issubclass(kind, (list, tuple, set, frozenset, dict, BaseModel)))


def read_settings(server: dict[str, object] | None = None) -> Settings:
    """The settings from the environment and the config file, with the ``server`` fields given
    on the command line (``serve --host/--port``) over them. Blocking."""
    settings = load_settings()
    if server:
        settings = load_settings(server=settings.server.model_dump() | server)
    return settings


def load_settings(**overrides: object) -> Settings:
    """Build ``Settings``, turning a validation failure, or a config file that cannot be read as
    TOML (a syntax error, an editor's write half done), into one readable ``SettingsError``."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            location = tuple(part for part in error["loc"] if not isinstance(part, int) or part >= 0)
            named = dotted(location, "settings")  # an admin body's keys cut short too
            where = f"{named} ({_source(location, overrides)})"
            lines.append(f"  {where}: {error['msg']}")
        raise SettingsError("invalid settings:\n" + "\n".join(lines)) from exc
    except SettingsError:
        raise
    except EnvironmentValueError as exc:  # pydantic-settings': a variable that does not parse
        named = ", ".join(_unparsable_variables(os.environ)) or f"an {ENV_PREFIX}* variable"
        raise SettingsError(f"{named} cannot be read: lists and tables are JSON, e.g. '[\"digits\"]' ({exc})") from exc
    except (ValueError, OSError) as exc:  # tomllib.TOMLDecodeError, UnicodeDecodeError, a read error
        raise SettingsError(f"config file {config_path()} cannot be read: {exc}") from exc
