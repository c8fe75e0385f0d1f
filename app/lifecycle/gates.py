"""Promotion gates: whether a candidate version may become a model's default.

Pure functions over manifests (no I/O, no torch), so the admin API can ask them before it
switches the default and show the operator every reason at once. A version is promoted
on figures measured by ``ai-backend eval``: the served precision's held-out accuracy may
not fall more than a margin below the current default's, and in fp16 it may not fall more
than a margin below the candidate's own fp32 figure (the FP16 gate).
"""

from __future__ import annotations

from typing import Literal

from app.inference.manifest import Manifest
from app.settings import env_name

Precision = Literal["fp32", "fp16"]

# Accuracies are ratios of counts, so two different figures differ by far more than this;
# the slack only keeps float rounding (0.9944 - 0.0100 != 0.9844) from refusing a drop
# that is exactly the margin.
_SLACK = 1e-9


def _name(manifest: Manifest) -> str:
    return f"{manifest.name}/{manifest.version}"


def _percent(value: float) -> str:
    return f"{value:.2%}"


def _points(value: float, *, unlike: float) -> str:
    """``value`` in percentage points, with enough decimals to read differently from ``unlike``."""
    text = ""
    for digits in (2, 4, 6):
        text = f"{value * 100:.{digits}f}"
        if text != f"{unlike * 100:.{digits}f}":
            break
    return f"{text} percentage points"


def _against_current(
    candidate: Manifest, accuracy: float, current: Manifest | None, precision: Precision, margin: float
) -> list[str]:
    """The accuracy gate; nothing to compare with (no default, or one never evaluated) passes."""
    if current is None or current.evaluation is None:
        return []
    baseline = current.evaluation.accuracy.get(precision)
    if baseline is None:
        return []
    drop = baseline - accuracy
    if drop <= margin + _SLACK:
        return []
    reason = (
        f"{_name(candidate)} has {_percent(accuracy)} held-out accuracy in {precision}, "
        f"{_points(drop, unlike=margin)} below the current default {_name(current)} ({_percent(baseline)}); "
        f"at most {_points(margin, unlike=drop)} below is allowed."
    )
    assert candidate.evaluation is not None  # the caller checked
    if candidate.evaluation.dataset != current.evaluation.dataset:
        reason += (
            f" Note that the two were measured on different held-out sets "
            f"({candidate.evaluation.dataset!r} and {current.evaluation.dataset!r})."
        )
    return [reason]


def _fp16_gate(candidate: Manifest, margin: float) -> list[str]:
    """The candidate's fp16 accuracy against its own fp32 accuracy."""
    assert candidate.evaluation is not None  # the caller checked
    fp16 = candidate.evaluation.accuracy.get("fp16")
    fp32 = candidate.evaluation.accuracy.get("fp32")
    if fp16 is None:  # reported already: not evaluated at the served precision
        return []
    if fp32 is None:
        return [
            f"{_name(candidate)} has no fp32 accuracy to check its fp16 accuracy ({_percent(fp16)}) against: "
            f"evaluate it in both precisions (`ai-backend eval` on a machine with CUDA does) before promoting it."
        ]
    drop = fp32 - fp16
    if drop <= margin + _SLACK:
        return []
    return [
        f"{_name(candidate)} loses {_points(drop, unlike=margin)} of held-out accuracy in fp16 "
        f"({_percent(fp16)}) against fp32 ({_percent(fp32)}); the FP16 gate allows at most "
        f"{_points(margin, unlike=drop)}: serve it in fp32 or fix its half-precision numerics."
    ]


def check_promotion(
    candidate: Manifest,
    current: Manifest | None,
    served_precision: Precision,
    accuracy_margin: float,
    fp16_margin: float,
) -> list[str]:
    """The reasons ``candidate`` may not replace ``current`` as the default; empty when it may.

    ``current`` is the default now being served (``None``: there is none, so only the
    candidate's own gates apply), ``served_precision`` the precision the service runs the
    candidate in. Margins are fractions of accuracy (0.005 = half a percentage point); a
    drop of exactly the margin is allowed. Raises ``ValueError`` for a margin outside 0-1.
    """
    for label, margin in (("accuracy_margin", accuracy_margin), ("fp16_margin", fp16_margin)):
        if not 0.0 <= margin <= 1.0:
            raise ValueError(f"{label} must be between 0 and 1 (a fraction of accuracy), got {margin}")
    evaluation = candidate.evaluation
    if evaluation is None or not evaluation.accuracy:
        return [
            f"{_name(candidate)} has no recorded held-out accuracy: run `ai-backend eval --model {candidate.name} "
            f"--version {candidate.version}` before promoting it (with --repository the served repository where "
            f"{env_name(('model', 'repository'))} is not set, and --data a held-out image folder for a model that "
            "train-digits did not build)."
        ]
    reasons: list[str] = []
    accuracy = evaluation.accuracy.get(served_precision)
    if accuracy is None:
        measured = " and ".join(sorted(evaluation.accuracy))
        where = " on a machine with CUDA" if served_precision == "fp16" else ""
        reasons.append(
            f"{_name(candidate)} was evaluated in {measured} only, but the service runs it in {served_precision}: "
            f"evaluate it in {served_precision}{where} before promoting it."
        )
    else:
        reasons += _against_current(candidate, accuracy, current, served_precision, accuracy_margin)
    if served_precision == "fp16":
        reasons += _fp16_gate(candidate, fp16_margin)
    return reasons
