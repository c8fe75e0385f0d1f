"""The batching policy while serving: changed through the admin API or the config file.

A change is validated as a whole, against the live settings, exactly as at start-up; an
invalid one is refused with the reason and the old policy stays. A valid one applies to
every batcher from its next batch. Changes are applied one at a time, on the event loop.

The config file is polled for changes (and re-read on SIGHUP); only the batching group
applies live, and every reload names the other settings that differ from those the process
runs with (they need a restart). Which wins,
the file or the admin API: the file when its batching changes (an edit), or when asked to
(SIGHUP, ``POST /admin/policy/reload``); an admin change stays until then, whatever else in
the file is edited.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry import trace
from pydantic import ValidationError

from app.errors import MAX_LISTED_ERRORS, SchemaError, dotted, not_listed
from app.settings import (
    ENV_PREFIX,
    BatchingSettings,
    FileStamp,
    Settings,
    SettingsError,
    check_windows,
    config_path,
    config_table_given,
    env_name,
    file_stamp,
    read_settings,
    read_stamped,
)

log = logging.getLogger(__name__)

Apply = Callable[[BatchingSettings], None]


class _Unseen(enum.Enum):
    UNSEEN = enum.auto()


UNSEEN = _Unseen.UNSEEN
"""No change seen yet: not None, which is the stamp of a missing file."""


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in patch.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _config_table(path: Path) -> dict[str, Any] | None:
    """The config file as written (blocking); None when it cannot be read or is no TOML. What an
    edit changed is told from it: the settings are the environment's where a variable sets a value."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _edited(
    before: Mapping[str, Any], after: Mapping[str, Any], location: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """The keys, as paths, that two tables (a file's, or settings dumped) set otherwise, added and
    removed ones included."""
    found: list[tuple[str, ...]] = []
    for key in [*before, *(k for k in after if k not in before)]:
        here = (*location, key)
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) or isinstance(new, dict):  # a table edited, added or removed: its keys
            found += _edited(old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}, here)
        elif old != new or (key in before) != (key in after):
            found.append(here)
    return found


def _overriding(location: tuple[str, ...], environ: Mapping[str, str]) -> list[str]:
    """The variables that set the setting at ``location`` (``("batching", "normal", "window_ms")``),
    or a key under it, over the file: its own, one under it, or a table above it given as JSON
    that holds it."""
    target = env_name(location)
    found = []
    for name, value in environ.items():
        upper = name.upper()  # pydantic-settings reads them whatever their case
        if upper == target or upper.startswith(target + "__"):
            found.append(name)
        elif upper.startswith(ENV_PREFIX) and target.startswith(upper + "__"):
            try:
                held: Any = json.loads(value)
            except ValueError:
                continue
            for part in target[len(upper) + 2 :].lower().split("__"):
                held = held.get(part) if isinstance(held, dict) else None
            if held is not None:
                found.append(name)
    return sorted(found)


class PolicyManager:
    """Holds the live batching settings and applies validated changes.

    ``stamp`` is the config file's as it was when ``settings`` were read (an edit made while
    the service started is picked up). ``read`` reads the settings again as they were read at
    start (blocking): the environment and the file, under whatever the command line or a Ray
    builder set over them, kept at every reload; ``config_file`` is the file they come from.
    """

    def __init__(
        self,
        settings: Settings,
        apply: Apply,
        stamp: FileStamp = None,
        read: Callable[[], Settings] = read_settings,
        config_file: Path | None = None,
    ) -> None:
        self._settings = settings  # live
        self._read = settings  # as the environment and the file said when last read
        self._apply = apply
        self._reader = read
        self.current = settings.batching
        self.config_file = config_file or config_path()
        self._stamp = stamp if stamp is not None else file_stamp(self.config_file)
        self._had_file = self._stamp is not None  # a file that goes away leaves the policy as it was
        self._lock = asyncio.Lock()  # one reload at a time: an older read never lands last
        self._wake = asyncio.Event()
        # the admin changes applied while a reload reads the file (None: no reload reads it): newer
        # than what the reload read, they go over it
        self._during_read: list[dict[str, Any]] | None = None
        # a change the watcher saw once: read if the next poll sees it too (a file gone is one)
        self._settling: FileStamp | _Unseen = UNSEEN
        # the file as written, to name the edits a variable overrides (blocking, as
        # the stamp's read: a small file, once, before serving)
        self._table = _config_table(self.config_file)

    def update(self, patch: dict[str, Any]) -> BatchingSettings:
        """Merge ``patch`` into the live policy; ``SchemaError`` (422) names what is wrong."""
        try:
            # strict: JSON's true is not a max batch of 1, nor "10" a window of 10 ms
            batching = self._checked(_merge(self.current.model_dump(), patch), strict=True)
        except SettingsError as exc:
            raise SchemaError(f"policy refused, the old one stays: {exc}") from exc
        if self._during_read is not None:
            self._during_read.append(patch)
        self._set(batching, "admin API")
        return batching

    async def reload(self, strict: bool = False, forced: bool = True) -> bool:
        """Re-read the environment and the config file (in a thread) and apply their batching
        (here): when it changed since the last read, or, ``forced``, whenever it differs from
        the live policy (an admin change is undone). True when the policy changed.

        An invalid file is logged and ignored, or with ``strict`` raised as ``SchemaError``.
        """
        async with self._lock:
            self._during_read = []
            try:
                return await self._reload(strict, forced)
            finally:
                self._during_read = None

    async def _reload(self, strict: bool, forced: bool) -> bool:
        """``reload`` under its lock, with ``_during_read`` collecting the admin changes made meanwhile."""
        # read once: checked, stamped and parsed from the same bytes, which the settings take too
        stamp, data = await asyncio.to_thread(read_stamped, self.config_file)
        try:
            if isinstance(stamp, str):  # its mode, say: as start-up would say
                raise SettingsError(f"config file {self.config_file} cannot be read: {stamp}")
            if data is None and self._had_file:  # between an editor's delete and its write, say
                raise SettingsError(f"config file {self.config_file} is missing")
            if data == b"" and self._had_file:  # truncated for a write
                raise SettingsError(f"config file {self.config_file} is empty")
            table, fresh = await asyncio.to_thread(self._read_given, data)
            # against the live settings: only batching applies, the rest waits for a restart
            batching = self._checked(fresh.batching.model_dump())
        except SettingsError as exc:
            self._stamp = stamp  # tried: the watcher waits for the next edit
            log.error("config reload refused, the old policy stays: %s", exc)
            if strict:
                raise SchemaError(f"config reload refused, the old policy stays: {exc}") from exc
            return False
        self._stamp = stamp
        self._had_file = self._had_file or stamp is not None
        # against what runs, not the last read: an edit undone needs no restart, and one
        # still pending is said again at every reload until the restart
        running, read = (settings.model_dump(exclude={"batching"}) for settings in (self._settings, fresh))
        pending = [".".join(path) for path in _edited(running, read)]  # names only: a value may be a secret
        if pending:
            log.warning("config changes to %s need a restart (only batching applies live)", ", ".join(pending))
        self._say_overridden(None if data is None else table)
        edited = fresh.batching != self._read.batching
        self._read = fresh
        if not (edited or forced):
            return False
        if patches := list(self._during_read or ()):  # admin changes made while the file was read
            try:
                batching = self._checked(functools.reduce(_merge, patches, batching.model_dump()))
            except SettingsError as exc:
                log.warning(
                    "config file not applied: with the admin change made while it was read it is invalid "
                    "(%s); the admin change stays",
                    exc,
                )
                return False
        if batching == self.current:
            return False
        self._set(batching, str(self.config_file) + (" under the admin change made meanwhile" if patches else ""))
        return True

    def _parsed(self, data: bytes | None) -> dict[str, Any]:
        """The config file's table, from its bytes (None: there is no file, and no table)."""
        try:
            return {} if data is None else tomllib.loads(data.decode("utf-8"))
        except ValueError as exc:  # tomllib.TOMLDecodeError, UnicodeDecodeError: as start-up says it
            raise SettingsError(f"config file {self.config_file} cannot be read: {exc}") from exc

    def _read_given(self, data: bytes | None) -> tuple[dict[str, Any], Settings]:
        """Blocking: the config file's table, parsed from ``data``, and the settings read again
        with their file part taken from that table."""
        table = self._parsed(data)
        with config_table_given(table):
            return table, self._reader()

    def _say_overridden(self, table: dict[str, Any] | None) -> None:
        """Warn of the file's edits that a variable overrides, in any group: they change nothing
        (the environment wins over the file), now or after a restart, and without a word the edit
        looked ignored (a setting that needs a restart is told so only where its value changed)."""
        if self._table is not None and table is not None:
            named = []
            for location in _edited(self._table, table):
                variables = _overriding(location, os.environ)
                if variables:
                    named.append(f"{'.'.join(location)} ({', '.join(variables)})")
            if named:
                log.warning(
                    "config file edits that the environment overrides do not apply (it wins over the file): %s",
                    "; ".join(named),
                )
        if table is not None:  # else there is no file: the next one is told from the last read
            self._table = table

    def _checked(self, batching: dict[str, Any], strict: bool = False) -> BatchingSettings:
        """The policy, valid on its own and with the live settings (a window shorter than the
        default deadline); ``SettingsError`` says why not."""
        try:
            valid = BatchingSettings.model_validate(batching, strict=strict)
        except ValidationError as exc:
            errors = exc.errors()
            said = "; ".join(f"{dotted(e['loc'], 'batching')}: {e['msg']}" for e in errors[:MAX_LISTED_ERRORS])
            raise SettingsError(said + not_listed(len(errors))) from exc
        # the rule alone, not Settings.model_validate: that reads the environment and the config
        # file again (pydantic-settings' sources), on the event loop, and a broken file would
        # refuse a valid admin change, the one way left to change the policy then
        try:
            check_windows(valid, self._settings.server)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc
        return valid

    def _set(self, batching: BatchingSettings, source: str) -> None:
        self._apply(batching)
        self.current = batching
        applied = batching.model_dump(mode="json")
        log.info("batching policy changed by %s: %s", source, applied)
        # on the span of the admin call (or none: a file watch's reload is in no request)
        trace.get_current_span().add_event("batching policy changed", {"source": source, "policy": json.dumps(applied)})

    def wake(self) -> None:
        """Re-read the config file now, as asked (SIGHUP): ``watch`` does it."""
        self._wake.set()

    async def watch(self, interval_s: float) -> None:
        """Reload when woken (``wake``), and when the config file changes, polled every
        ``interval_s`` (0: only when woken). Runs until cancelled; a failed reload is logged and
        never ends it."""
        while True:
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can drop the closing cancel
                async with asyncio.timeout(interval_s or None):
                    await self._wake.wait()
            forced = self._wake.is_set()
            self._wake.clear()
            stamp = await asyncio.to_thread(file_stamp, self.config_file)
            if not forced and stamp == self._stamp:
                continue
            if not forced and stamp != self._settling:
                # an editor's write in place may be under way (the file truncated, half written,
                # and valid TOML all the same), or its save by rename (the file gone for a moment):
                # a change is read once it holds for one interval
                self._settling = stamp
                continue
            self._settling = UNSEEN
            try:
                await self.reload(forced=forced)
            except Exception:
                self._stamp = stamp  # not again until the file changes
                log.exception("config reload failed; the old policy stays")
