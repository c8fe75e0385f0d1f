"""The batching policy while serving: changed through the admin API or the config file.

A change is validated as a whole, exactly as at start-up; an invalid one is refused with
the reason and the old policy stays. A valid one applies to every batcher from its next
batch. The config file is polled for changes (and re-read on SIGHUP); only the batching
group applies live, and a change to anything else is logged as needing a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.errors import SchemaError
from app.settings import (
    CONFIG_FILE_ENV,
    DEFAULT_CONFIG_FILE,
    BatchingSettings,
    Settings,
    SettingsError,
    load_settings,
)

log = logging.getLogger(__name__)

Apply = Callable[[BatchingSettings], None]


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in patch.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


class PolicyManager:
    """Holds the live batching settings and applies validated changes."""

    def __init__(self, settings: Settings, apply: Apply) -> None:
        self._settings = settings
        self._apply = apply
        self.current = settings.batching
        self.config_file = Path(os.environ.get(CONFIG_FILE_ENV, DEFAULT_CONFIG_FILE))
        self._mtime = self._stat()

    def update(self, patch: dict[str, Any]) -> BatchingSettings:
        """Merge ``patch`` into the live policy; ``SchemaError`` (422) names what is wrong."""
        try:
            batching = BatchingSettings.model_validate(_merge(self.current.model_dump(), patch))
            # the rules that span groups (a window shorter than the default deadline) hold too
            Settings.model_validate(self._settings.model_dump() | {"batching": batching.model_dump()})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'batching'}: {e['msg']}" for e in exc.errors())
            raise SchemaError(f"policy refused, the old one stays: {problems}") from exc
        self._set(batching, "admin API")
        return batching

    def reload(self, strict: bool = False) -> bool:
        """Re-read settings (environment and config file); apply a batching change. Blocking.

        An invalid file is logged and ignored, or with ``strict`` raised as ``SchemaError``.
        """
        try:
            fresh = load_settings()
        except SettingsError as exc:
            log.error("config reload refused, the old policy stays: %s", exc)
            if strict:
                raise SchemaError(f"config reload refused, the old policy stays: {exc}") from exc
            return False
        others = {
            k for k in Settings.model_fields if k != "batching" and getattr(fresh, k) != getattr(self._settings, k)
        }
        if others:
            log.warning("config changes to %s need a restart; only batching applies live", sorted(others))
        if fresh.batching == self.current:
            return False
        self._set(fresh.batching, str(self.config_file))
        return True

    def _set(self, batching: BatchingSettings, source: str) -> None:
        self._apply(batching)
        self.current = batching
        log.info("batching policy changed by %s: %s", source, batching.model_dump())

    def _stat(self) -> float | None:
        try:
            return self.config_file.stat().st_mtime
        except OSError:
            return None

    async def watch(self, interval_s: float) -> None:
        """Poll the config file's modification time; reload when it changes. Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            mtime = await asyncio.to_thread(self._stat)
            if mtime != self._mtime:
                self._mtime = mtime
                await asyncio.to_thread(self.reload)
