"""Print the README's settings table from the Settings model, so the two cannot drift."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from app.settings import env_name, load_settings


def _format(value: object) -> str:
    return json.dumps(str(value) if isinstance(value, Path) else value)


def rows(instance: BaseModel, path: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    """(dotted name, environment variable, code default, description) for every leaf setting."""
    out: list[tuple[str, str, str, str]] = []
    for name, field in type(instance).model_fields.items():
        location = (*path, name)
        value = getattr(instance, name)
        if isinstance(value, BaseModel):
            out += rows(value, location)
        else:
            out.append((".".join(location), env_name(location), _format(value), field.description or ""))
    return out


def table() -> str:
    """The settings as config/default.toml leaves them (run from the repository root)."""
    lines = ["| setting | environment variable | default | what it does |", "| --- | --- | --- | --- |"]
    for dotted, env, default, notes in rows(load_settings()):
        lines.append(f"| `{dotted}` | `{env}` | `{default}` | {notes} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
