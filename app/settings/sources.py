"""Where settings come from, and the error that names a bad one: the environment variables'
names, the config file (its path, and a stamp that tells when it changed), and the files that
hold the secrets."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

if TYPE_CHECKING:
    from app.settings.groups import Settings

ENV_PREFIX = "AI_SERVICE_"
CONFIG_FILE_ENV = "AI_SERVICE_CONFIG_FILE"
DEFAULT_CONFIG_FILE = Path("config/default.toml")


class SettingsError(ValueError):
    """A setting is invalid; the message names it, its environment variable and the rule."""


def read_secrets(settings: Settings) -> tuple[bytes | None, bytes | None]:
    """The admin token (while the admin API is on) and the API key, from their settings or
    their files. Blocking; ``SettingsError`` names the setting whose file cannot be used."""
    token, key = read_each_secret(settings)
    if isinstance(token, SettingsError):
        raise token
    if isinstance(key, SettingsError):
        raise key
    return token, key


def read_each_secret(settings: Settings) -> tuple[bytes | SettingsError | None, bytes | SettingsError | None]:
    """As ``read_secrets``, each on its own: a file that cannot be used is that secret's
    ``SettingsError``, and the other is read all the same. Blocking."""
    admin, server = settings.admin, settings.server
    token = _secret_or_error(admin.token, admin.token_file, ("admin", "token_file")) if admin.enabled else None
    return token, _secret_or_error(server.api_key, server.api_key_file, ("server", "api_key_file"))


def _secret_or_error(
    value: SecretStr | None, file: Path | None, where: tuple[str, str]
) -> bytes | SettingsError | None:
    try:
        return _secret(value, file, where)
    except SettingsError as exc:
        return exc


def _secret(value: SecretStr | None, file: Path | None, where: tuple[str, str]) -> bytes | None:
    if value is not None:
        return value.get_secret_value().encode()
    if file is None:
        return None
    setting = f"{'.'.join(where)} ({env_name(where)})"
    try:
        secret = file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{setting}: {file} cannot be read: {exc}") from exc
    if len(secret) < 16:
        raise SettingsError(f"{setting}: {file} holds fewer than 16 characters")
    return secret.encode()


def env_name(location: tuple[int | str, ...]) -> str:
    """The environment variable for a setting's location, e.g. ``AI_SERVICE_MODEL__DEVICE``."""
    return ENV_PREFIX + "__".join(str(part).upper() for part in location)


def config_path() -> Path:
    """The config file: ``AI_SERVICE_CONFIG_FILE``, or ``config/default.toml`` (relative to the
    working directory). Set but empty (a compose file's unset variable) is an error where it is
    read (``Settings``), not the working directory taken for a file."""
    return Path(os.environ.get(CONFIG_FILE_ENV) or DEFAULT_CONFIG_FILE)


FileStamp = tuple[int, int, int, bytes] | str | None
"""A file's identity and version: inode, size, mtime in ns and a digest of its bytes; a string:
why it cannot be read (``Permission denied``); None: absent."""


def file_stamp(path: Path) -> FileStamp:
    """Blocking. Changes when the file is edited in place or replaced (an editor's rename), and
    when two writes of the same size land within one tick of the file system's clock."""
    return read_stamped(path)[0]


def read_stamped(path: Path) -> tuple[FileStamp, bytes | None]:
    """Blocking: the file's stamp (``file_stamp``) and the bytes it was taken from (None where
    there are none). Whoever reads the file for its content reads it here, once: a second read
    could find an editor's write under way, another file than the one stamped."""
    try:
        stat = path.stat()
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # a dangling link (a ConfigMap's key removed) too
        return None, None
    except OSError as exc:
        return exc.strerror or str(exc), None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns, hashlib.blake2b(data, digest_size=16).digest()), data


# the config file's table as a caller read it (``config_table_given``); None: the settings read the file
_GIVEN_TABLE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("config_table", default=None)


@contextlib.contextmanager
def config_table_given(table: dict[str, Any]) -> Iterator[None]:
    """Settings built within take the config file's part from ``table`` (the file as the caller
    read and checked it) instead of reading the file again. In this context only: this thread,
    or this task."""
    token = _GIVEN_TABLE.set(table)
    try:
        yield
    finally:
        _GIVEN_TABLE.reset(token)


def given_config_table() -> dict[str, Any] | None:
    """The table ``config_table_given`` holds here, a copy (a source may change what it is given);
    None outside it."""
    table = _GIVEN_TABLE.get()
    return None if table is None else copy.deepcopy(table)
