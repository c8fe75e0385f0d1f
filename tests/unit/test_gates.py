"""Promotion gates: every reason to refuse, its boundaries, and a real regression caught end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.inference.manifest import Evaluation, Manifest
from app.lifecycle.evaluate import main as evaluate_main
from app.lifecycle.gates import check_promotion
from tests.lifecycle_support import copy_version, degrade_head
from tests.support import DIGITS_DIR

BASE = Manifest.read(DIGITS_DIR / "1")
DATASET = "held-out"


def version(number: str, accuracy: dict[str, float] | None, dataset: str = DATASET) -> Manifest:
    """The bundled manifest as version ``number``, evaluated at ``accuracy`` (``None``: never evaluated)."""
    evaluation = None if accuracy is None else Evaluation(dataset=dataset, samples=360, accuracy=accuracy)
    return BASE.model_copy(update={"version": number, "evaluation": evaluation})


def gate(
    candidate: Manifest, current: Manifest | None, served: str = "fp32", margin: float = 0.005, fp16: float = 0.01
) -> list[str]:
    return check_promotion(candidate, current, served, margin, fp16)  # type: ignore[arg-type]


CURRENT = version("1", {"fp32": 0.99, "fp16": 0.99})


# --- not evaluated ----------------------------------------------------------------------


@pytest.mark.parametrize("accuracy", [None, {}])
def test_a_candidate_never_evaluated_is_refused(accuracy: dict[str, float] | None) -> None:
    reasons = gate(version("2", accuracy), CURRENT)
    assert reasons == [
        "digits/2 has no recorded held-out accuracy: run `ai-backend eval --model digits --version 2` "
        "before promoting it (with --repository the served repository where AI_SERVICE_MODEL__REPOSITORY is not "
        "set, and --data a held-out image folder for a model that train-digits did not build)."
    ]


def test_a_candidate_not_evaluated_at_the_served_precision_is_refused() -> None:
    assert gate(version("2", {"fp32": 0.99}), CURRENT, served="fp16") == [
        "digits/2 was evaluated in fp32 only, but the service runs it in fp16: "
        "evaluate it in fp16 on a machine with CUDA before promoting it."
    ]
    assert gate(version("2", {"fp16": 0.99}), CURRENT, served="fp32") == [
        "digits/2 was evaluated in fp16 only, but the service runs it in fp32: evaluate it in fp32 before promoting it."
    ]


# --- against the current default --------------------------------------------------------


def test_an_accuracy_drop_beyond_the_margin_is_refused_with_both_figures_and_the_margin() -> None:
    assert gate(version("2", {"fp32": 0.95}), CURRENT) == [
        "digits/2 has 95.00% held-out accuracy in fp32, 4.00 percentage points below the current default "
        "digits/1 (99.00%); at most 0.50 percentage points below is allowed."
    ]


def test_a_drop_of_exactly_the_margin_is_allowed_and_a_hair_more_is_not() -> None:
    # 0.99 - 0.985 is 0.0050000000000000044 in floating point: still exactly the margin
    assert gate(version("2", {"fp32": 0.985}), CURRENT) == []
    (reason,) = gate(version("2", {"fp32": 0.9849}), CURRENT)
    assert "0.51 percentage points below" in reason and "at most 0.50 percentage points" in reason
    # Figures as eval writes them: counts over 360 samples, the margin two samples
    assert gate(version("2", {"fp32": 356 / 360}), version("1", {"fp32": 358 / 360}), margin=2 / 360) == []
    assert gate(version("2", {"fp32": 355 / 360}), version("1", {"fp32": 358 / 360}), margin=2 / 360) != []


def test_a_drop_just_past_the_margin_shows_enough_decimals_to_tell_them_apart() -> None:
    (reason,) = gate(version("2", {"fp32": 0.98498}), CURRENT)
    assert "0.5020 percentage points below" in reason and "at most 0.5000 percentage points" in reason


def test_better_equal_or_uncomparable_candidates_are_allowed() -> None:
    candidate = version("2", {"fp32": 0.97})
    assert gate(version("2", {"fp32": 0.999}), CURRENT) == []
    assert gate(version("2", {"fp32": 0.99}), CURRENT) == []
    assert gate(candidate, None) == []  # no default yet: only the candidate's own gates
    assert gate(candidate, version("1", None)) == []  # the default was never evaluated
    assert gate(candidate, version("1", {"fp16": 0.99})) == []  # nor at this precision
    assert gate(candidate, CURRENT, margin=0.02) == []


def test_the_accuracy_reason_notes_different_heldout_sets() -> None:
    (reason,) = gate(version("2", {"fp32": 0.9}, dataset="image folder a"), CURRENT)
    assert reason.endswith(
        "Note that the two were measured on different held-out sets ('image folder a' and 'held-out')."
    )


@given(
    samples=st.integers(1, 10_000),
    data=st.data(),
)
def test_the_margin_is_exact_on_figures_that_are_counts(samples: int, data: st.DataObject) -> None:
    current, candidate, margin = (data.draw(st.integers(0, samples)) for _ in range(3))
    reasons = gate(
        version("2", {"fp32": candidate / samples}), version("1", {"fp32": current / samples}), margin=margin / samples
    )
    assert (reasons == []) == (current - candidate <= margin)


# --- the FP16 gate ----------------------------------------------------------------------


def test_the_fp16_gate() -> None:
    at_margin = version("2", {"fp32": 0.99, "fp16": 0.98})
    assert gate(at_margin, CURRENT, served="fp16", margin=0.05, fp16=0.01) == []
    beyond = version("2", {"fp32": 0.99, "fp16": 0.97})
    assert gate(beyond, CURRENT, served="fp16", margin=0.05, fp16=0.01) == [
        "digits/2 loses 2.00 percentage points of held-out accuracy in fp16 (97.00%) against fp32 (99.00%); "
        "the FP16 gate allows at most 1.00 percentage points: serve it in fp32 or fix its half-precision numerics."
    ]
    assert gate(beyond, CURRENT, served="fp32", margin=0.05, fp16=0.01) == []  # served in fp32: no FP16 gate
    assert gate(beyond, None, served="fp16", fp16=0.02) == []


def test_an_fp16_figure_without_an_fp32_one_cannot_pass_the_fp16_gate() -> None:
    assert gate(version("2", {"fp16": 0.99}), CURRENT, served="fp16") == [
        "digits/2 has no fp32 accuracy to check its fp16 accuracy (99.00%) against: evaluate it in both "
        "precisions (`ai-backend eval` on a machine with CUDA does) before promoting it."
    ]


def test_every_reason_is_given_at_once() -> None:
    reasons = gate(version("2", {"fp32": 0.99, "fp16": 0.90}), CURRENT, served="fp16")
    assert len(reasons) == 2
    assert "below the current default digits/1 (99.00%)" in reasons[0]
    assert "the FP16 gate" in reasons[1]


@pytest.mark.parametrize(("margin", "fp16"), [(-0.01, 0.01), (0.01, 1.5)])
def test_margins_outside_zero_to_one_are_a_programming_error(margin: float, fp16: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        gate(version("2", {"fp32": 0.99}), CURRENT, margin=margin, fp16=fp16)


# --- a real regression ------------------------------------------------------------------


def test_a_degraded_retrain_is_evaluated_and_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """digits/2 is digits/1 with noise in its classifier head, as a bad retrain might leave it."""
    root = tmp_path / "models"
    copy_version(root, "1")
    degraded = degrade_head(copy_version(root, "2"), noise=0.5, seed=0)

    current = Manifest.read(root / "digits" / "1")
    assert gate(degraded, current)[0].startswith("digits/2 has no recorded held-out accuracy")

    # both on the same held-out set, through the same decode path, so the comparison is fair
    for number in ("1", "2"):
        assert (
            evaluate_main(["--model", "digits", "--version", number, "--repository", str(root), "--device", "cpu"]) == 0
        )
    capsys.readouterr()
    current, degraded = Manifest.read(root / "digits" / "1"), Manifest.read(root / "digits" / "2")
    assert current.evaluation is not None and degraded.evaluation is not None
    before, after = current.evaluation.accuracy["fp32"], degraded.evaluation.accuracy["fp32"]
    assert after < before - 0.02  # measured: 0.9583 against 0.9972 (345 and 359 of 360)

    (reason,) = gate(degraded, current, margin=0.005)
    assert reason == (
        f"digits/2 has {after:.2%} held-out accuracy in fp32, {(before - after) * 100:.2f} percentage points "
        f"below the current default digits/1 ({before:.2%}); at most 0.50 percentage points below is allowed."
    )
    assert gate(current, degraded) == []  # going back to the better version is allowed
    # served in fp16 (a CUDA deployment), the CPU-only evaluation is not enough either
    assert "evaluated in fp32 only, but the service runs it in fp16" in gate(degraded, current, served="fp16")[0]
