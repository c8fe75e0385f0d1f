"""Right answers through every way in: JSON, raw PNG, JPEG and WebP, both predict routes."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import pytest

from tests.conftest import SettingsFactory
from tests.support import LABELS, MODEL_NAME, b64, reencode, running_app, sample_png, top_label

ROUTES = ("/predict", f"/v1/models/{MODEL_NAME}/predict")


def _check_answer(body: dict[str, Any], expected: str, top_k: int) -> None:
    """One well-formed response whose best class is ``expected``."""
    assert top_label(body) == expected, body
    predictions = body["predictions"]
    assert isinstance(predictions, list) and len(predictions) == top_k
    probabilities = [p["probability"] for p in predictions]
    assert probabilities == sorted(probabilities, reverse=True)
    assert all(0.0 <= p <= 1.0 for p in probabilities)
    assert sum(probabilities) <= 1.0 + 1e-5
    assert all(p["label"] == LABELS[p["class_index"]] for p in predictions)
    assert len({p["class_index"] for p in predictions}) == top_k
    assert body["model"] == MODEL_NAME and body["version"] == "1"
    assert body["lane"] == "normal" and body["batch_size"] >= 1
    timings = body["timings"]
    assert isinstance(timings, dict) and set(timings) == {"preprocess", "queue", "inference", "total"}
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in timings.values())


@pytest.mark.parametrize("route", ROUTES)
async def test_samples_as_json_are_classified_right(
    make_settings: SettingsFactory, sample_pngs: dict[str, bytes], route: str
) -> None:
    async with running_app(make_settings()) as running:
        for label, png in sample_pngs.items():
            response = await running.client.post(route, json={"image_base64": b64(png), "top_k": 3})
            assert response.status_code == 200, response.text
            _check_answer(response.json(), label, top_k=3)


@pytest.mark.parametrize("route", ROUTES)
async def test_samples_as_raw_png_are_classified_right(
    make_settings: SettingsFactory, sample_pngs: dict[str, bytes], route: str
) -> None:
    async with running_app(make_settings()) as running:
        labels = list(sample_pngs)
        responses = await asyncio.gather(
            *(running.predict_png(sample_pngs[label], path=route, params={"top_k": 10}) for label in labels)
        )
        for label, response in zip(labels, responses, strict=True):
            assert response.status_code == 200, response.text
            _check_answer(response.json(), label, top_k=10)
            # every class is listed once: the probabilities are a distribution
            assert sum(p["probability"] for p in response.json()["predictions"]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    ("fmt", "content_type", "params"),
    [
        ("JPEG", "image/jpeg", {"quality": 95}),
        ("WEBP", "image/webp", {"quality": 95}),
        ("WEBP", "image/webp", {"lossless": True}),
    ],
)
async def test_other_formats_are_classified_right(
    make_settings: SettingsFactory,
    sample_pngs: dict[str, bytes],
    fmt: str,
    content_type: str,
    params: dict[str, object],
) -> None:
    images = {label: reencode(png, fmt, size=96, **params) for label, png in sample_pngs.items()}

    async def both(image: bytes) -> tuple[httpx.Response, httpx.Response]:
        raw = await running.client.post("/predict", content=image, headers={"Content-Type": content_type})
        as_json = await running.client.post("/predict", json={"image_base64": b64(image)})
        return raw, as_json

    async with running_app(make_settings()) as running:
        answers = await asyncio.gather(*(both(image) for image in images.values()))
    for label, (raw, as_json) in zip(images, answers, strict=True):
        assert raw.status_code == 200, raw.text
        _check_answer(raw.json(), label, top_k=5)
        assert as_json.status_code == 200, as_json.text
        # the same image gives the same answer either way (up to float noise between batch sizes)
        raw_predictions, json_predictions = raw.json()["predictions"], as_json.json()["predictions"]
        assert [p["class_index"] for p in json_predictions] == [p["class_index"] for p in raw_predictions]
        assert [p["probability"] for p in json_predictions] == pytest.approx(
            [p["probability"] for p in raw_predictions], abs=1e-4
        )


async def test_top_k_defaults_and_a_json_bodys_own(
    make_settings: SettingsFactory, sample_pngs: dict[str, bytes]
) -> None:
    async with running_app(make_settings(server={"default_top_k": 4})) as running:
        png = sample_pngs["7"]
        default = await running.client.post("/predict", json={"image_base64": b64(png)})
        assert default.status_code == 200, default.text
        assert len(default.json()["predictions"]) == 4
        raw_default = await running.predict_png(png)
        assert len(raw_default.json()["predictions"]) == 4
        one = await running.client.post("/predict", json={"image_base64": b64(png), "top_k": 1})
        assert [p["label"] for p in one.json()["predictions"]] == ["7"]


async def test_a_top_k_in_the_query_and_the_body_is_one_value_or_a_422(make_settings: SettingsFactory) -> None:
    """The body's silently won over the query's: as two values of one header, which the server
    read would decide how many classes came back."""
    body = {"image_base64": b64(sample_png(7)), "top_k": 2}
    async with running_app(make_settings()) as running:
        same = await running.client.post("/predict", params={"top_k": 2}, json=body)
        other = await running.client.post("/predict", params={"top_k": 3}, json=body)
        unnamed = {"image_base64": body["image_base64"]}
        query_only = await running.client.post("/predict", params={"top_k": 3}, json=unnamed)
    assert same.status_code == 200 and len(same.json()["predictions"]) == 2, same.text
    assert other.status_code == 422 and other.json()["code"] == "validation_error", other.text
    assert "top_k is 3 in the query and 2 in the body" in other.json()["message"]
    assert query_only.status_code == 200 and len(query_only.json()["predictions"]) == 3


async def test_a_query_top_k_given_twice_is_one_value_or_a_422(make_settings: SettingsFactory) -> None:
    """Two values for one parameter: the last was taken without a word (as two prediction
    headers with two values, it is refused)."""
    png = sample_png(7)
    async with running_app(make_settings()) as running:
        same = await running.predict_png(png, params=[("top_k", "2"), ("top_k", "2")])
        other = await running.predict_png(png, params=[("top_k", "2"), ("top_k", "3")])
    assert same.status_code == 200 and len(same.json()["predictions"]) == 2, same.text
    assert other.status_code == 422 and other.json()["code"] == "validation_error", other.text
    assert other.json()["details"][0]["loc"] == ["query", "top_k"]


async def test_content_type_parameters_and_case_are_accepted(
    make_settings: SettingsFactory, sample_pngs: dict[str, bytes]
) -> None:
    async with running_app(make_settings()) as running:
        png = sample_pngs["4"]
        as_json = await running.client.post(
            "/predict",
            content=f'{{"image_base64": "{b64(png)}"}}'.encode(),
            headers={"Content-Type": "Application/JSON; charset=utf-8"},
        )
        assert as_json.status_code == 200, as_json.text
        raw = await running.client.post("/predict", content=png, headers={"Content-Type": "IMAGE/PNG"})
        assert raw.status_code == 200, raw.text
        assert top_label(as_json.json()) == top_label(raw.json()) == "4"


async def test_transparent_png_composites_onto_dark_ground(
    make_settings: SettingsFactory, sample_pngs: dict[str, bytes]
) -> None:
    """A light digit drawn only through the alpha channel still reads as the digit."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(sample_pngs["2"])) as image:
        gray = image.convert("L")
    rgba = Image.new("RGBA", gray.size, (255, 255, 255, 0))
    rgba.putalpha(gray)
    out = io.BytesIO()
    rgba.save(out, format="PNG")
    async with running_app(make_settings()) as running:
        response = await running.predict_png(out.getvalue())
        assert response.status_code == 200, response.text
        assert top_label(response.json()) == "2"


async def test_the_timings_add_up_where_a_batch_decodes_its_images(
    make_settings: SettingsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding in its batch, a request waits while its batchmates' images decode: that time was in
    no field, a third of the total in a batch of 16 photos. It is in ``inference`` (its time in
    its batch), so the stages add up to about the total."""
    import time

    from app.inference import preprocess

    real = preprocess.decode

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)  # a large photo's decode, on the batch's thread
        return real(*args, **kwargs)

    monkeypatch.setattr(preprocess, "decode", slow)
    settings = make_settings(server={"decode": "batch"}, batching={"normal": {"window_ms": 100.0, "max_batch": 4}})
    async with running_app(settings) as running:
        answers = await asyncio.gather(*(running.predict_png(sample_png(d)) for d in range(4)))
    for answer in answers:
        assert answer.status_code == 200 and answer.json()["batch_size"] == 4, answer.text
        timings = answer.json()["timings"]
        staged = timings["preprocess"] + timings["queue"] + timings["inference"]
        assert timings["preprocess"] >= 50, "its own decode"
        assert staged >= 0.9 * timings["total"], timings
