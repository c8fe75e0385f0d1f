"""The ratio report: py-spy's raw output, CPU per thread group, saturation and side-by-side variants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.bench.ratio import cli
from app.bench.ratio.compare import Run, compare, compare_markdown
from app.bench.ratio.profile import parse_collapsed, short, stage_of, summarise_profile
from app.bench.ratio.report import build_report, markdown

SITE = "/venv/lib/python3.11/site-packages"
RAW = "\n".join(
    [
        f"thread (100): MainThread;run (/app/app/cli.py);Runner.run ({SITE}/../asyncio/runners.py) 40",
        f"thread (100): MainThread;handle ({SITE}/starlette/routing.py);read_image_body (/r/app/api/body.py);"
        "base64_bytes (/r/app/inference/preprocess.py) 30",
        f"thread (100): MainThread;handle ({SITE}/starlette/routing.py);start_span ({SITE}/opentelemetry/trace.py) 20",
        f"thread (100): MainThread;handle ({SITE}/starlette/routing.py) 10",
        "thread (201): preprocess_0;_worker (/usr/lib/python3.11/concurrent/futures/thread.py) 50",
        f"thread (201): preprocess_0;decode (/r/app/inference/preprocess.py);ImageFile.load ({SITE}/PIL/File.py) 30",
        f"thread (202): preprocess_1;decode (/r/app/inference/preprocess.py);Image.resize ({SITE}/PIL/Image.py) 10",
        "thread (0x12d): device;probabilities (/r/app/inference/loader.py) 25",
    ]
)


def test_raw_lines_parse_into_thread_frames_and_counts() -> None:
    samples = parse_collapsed(RAW)
    assert [s.tid for s in samples][:1] == [100] and samples[-1].tid == 0x12D
    assert samples[1].thread == "MainThread" and samples[1].count == 30 and len(samples[1].frames) == 3
    with pytest.raises(ValueError):
        parse_collapsed("no thread here 3")


def test_a_sample_belongs_to_the_stage_of_its_deepest_named_frame() -> None:
    frames = ("a (x/starlette/routing.py)", "b (r/app/api/body.py)", "base64_bytes (r/app/inference/preprocess.py)")
    assert stage_of(frames) == "base64 decode"
    assert stage_of(("mystery (nowhere.py)",)) == "other: mystery (nowhere.py)"
    # the fast path's decode and resize run in C under these frames (simplejpeg, torch's uint8 kernel)
    run = ("run (r/app/inference/runner.py)", "decode (r/app/inference/preprocess.py)")
    assert stage_of((*run, "_decode_reduced (r/app/inference/preprocess.py)")) == "JPEG decode"
    assert stage_of((*run, "decode_reduced (r/app/inference/jpeg.py)")) == "JPEG decode"
    assert stage_of((*run, "_resized_tensor (r/app/inference/preprocess.py)")) == "resize"
    assert short(f"f ({SITE}/starlette/routing.py)") == "f (starlette/routing.py)"
    assert short("g (/work/main/app/service.py)") == "g (app/service.py)"


def test_the_summary_gives_cores_per_group_from_proc_and_shares_of_busy_samples() -> None:
    before = {100: ("ai-backend", 10.0), 201: ("ai-backend", 5.0), 202: ("ai-backend", 5.0), 0x12D: ("x", 0.0)}
    before[300] = ("omp", 1.0)
    after = {100: ("ai-backend", 12.0), 201: ("ai-backend", 6.0), 202: ("ai-backend", 6.0), 0x12D: ("x", 4.0)}
    after[300] = ("omp", 2.0)
    summary = summarise_profile(parse_collapsed(RAW), before, after, window_s=4.0)
    groups = {g["group"]: g for g in summary["groups"]}
    assert groups["device"]["cores"] == 1.0
    assert groups["MainThread"]["cores"] == 0.5 and groups["preprocess"]["cores"] == 0.5
    assert groups["preprocess"]["threads"] == 2
    assert groups["native (omp)"]["cores"] == 0.25 and groups["native (omp)"]["samples"] == 0
    main = {s["name"]: s["share"] for s in groups["MainThread"]["stages"]}
    assert groups["MainThread"]["idle_samples"] == 40, "uvloop's run loop is counted apart"
    assert main == {
        "base64 decode": 0.5,
        "tracing (OpenTelemetry)": 0.3333,
        "routing + middleware (Starlette, FastAPI)": 0.1667,
    }
    decode = {s["name"]: s["share"] for s in groups["preprocess"]["stages"]}
    assert decode == {"JPEG decode": 0.75, "resize": 0.25} and groups["preprocess"]["idle_samples"] == 50
    assert summary["cores"] == 2.25


def bench(concurrency: int, rps: float, server_ms: float | None = 5.0) -> dict[str, Any]:
    latency = {"count": 10, "p50_ms": 100.0, "p90_ms": 150.0, "p99_ms": 200.0, "max_ms": 210.0}
    empty = {"count": 0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    cpu = {"server_ms_per_request": server_ms, "other_cores": 0.1, "server_cores": 1.8} if server_ms else {}
    return {
        "concurrency": concurrency,
        "throughput_rps": rps,
        "mean_batch_size": 12.0,
        "latency": {"all": latency, "normal": latency, "urgent": empty},
        "errors": {},
        "cpu": cpu,
    }


LIMIT = {"limit": {"images_per_s": 400.0, "cpu_ms_per_image": 4.5, "best_batch": 16}}


def test_the_report_takes_the_best_throughput_as_saturation() -> None:
    report = build_report(LIMIT, [bench(16, 300.0), bench(64, 340.0, 5.0), bench(128, 330.0)], None, {"a": "1"})
    sat = report["saturation"]
    assert sat["concurrency"] == 64 and sat["ratio"] == 0.85
    assert sat["cpu_ratio"] == 0.9 and sat["overhead_cpu_ms_per_request"] == 0.5
    assert [row["ratio"] for row in report["sweep"]] == [0.75, 0.85, 0.825]
    text = markdown(report)
    assert "service / limit: 0.85" in text and "`a=1`" in text


def test_an_end_whose_formula_is_below_what_every_core_served_then_is_raised_to_it() -> None:
    # the limit timed in a slow stretch: the same measurement's every-core run served more
    slow = {
        "limit": {"images_per_s": 300.0, "cpu_ms_per_image": 6.0, "best_batch": 16, "every_core_images_per_s": 350.0}
    }
    after = {
        "limit": {"images_per_s": 450.0, "cpu_ms_per_image": 4.0, "best_batch": 16, "every_core_images_per_s": 420.0}
    }
    report = build_report(slow, [bench(64, 320.0)], None, {}, limit_after=after)
    assert report["limit_runs_images_per_s"] == [350.0, 450.0] and report["limit_images_per_s"] == 400.0
    assert report["saturation"]["ratio"] == 0.8 and report["saturation"]["ratio_by_end"] == [0.9143, 0.7111]
    assert report["limit_cpu_ms_per_image"] == pytest.approx((6.0 * 300 / 350 + 4.0) / 2, abs=1e-4)
    text = markdown(report)
    assert "service / limit: 0.80 (against each end of the run alone: 0.91, 0.71)" in text
    assert "300.0 by the formula" in text and "450.0 by the formula" not in text


def test_a_bench_with_no_batch_size_shows_a_dash_in_the_markdown() -> None:
    """A concurrency whose answers all failed (or a rival's, which carry none): bench reports null."""
    unsized = bench(64, 340.0) | {"mean_batch_size": None}
    text = markdown(build_report(LIMIT, [unsized, bench(16, 300.0)], None, {}))
    assert "requests/s, mean batch -" in text
    assert "| 64 | 340.0 | 0.85 | - | 100 |" in text and "| 16 | 300.0 | 0.75 | 12.0 | 100 |" in text


def test_the_server_s_own_loop_lag_in_the_saturation_window_is_reported() -> None:
    lag = {"samples": 40, "mean_ms": 2.5, "p99_at_most_ms": 25.0, "max_at_most_ms": None, "over_250ms": 1}
    saturated = bench(64, 340.0) | {"server_loop_lag": lag}
    text = markdown(build_report(LIMIT, [bench(16, 300.0), saturated], None, {}))
    assert "event loop, 40 lag samples: mean 2.5 ms, p99 <= 25 ms, max past the last bucket, **1** over 250 ms" in text
    slower = saturated | {"throughput_rps": 100.0}  # saturation is another run, which scraped nothing
    assert "lag samples" not in markdown(build_report(LIMIT, [slower, bench(8, 300.0)], None, {}))


def test_variants_are_compared_by_the_median_of_their_rounds() -> None:
    runs: list[Run] = [
        ("a", bench(64, 300.0), None),
        ("b", bench(64, 360.0, 4.5), None),
        ("a", bench(64, 320.0), None),
        ("b", bench(64, 340.0), None),
    ]
    result = compare(LIMIT, runs)
    rows = {row["variant"]: row for row in result["variants"]}
    assert rows["a"]["median_rps"] == 310.0 and rows["a"]["rounds"] == 2
    assert rows["b"]["ratio"] == 0.875 and rows["b"]["cpu_ratio"] == pytest.approx((4.5 / 4.5 + 4.5 / 5) / 2, abs=1e-4)
    assert "| b | 350.0 (360, 340)" in compare_markdown(result)


def test_a_rival_whose_answers_carry_no_batch_size_is_compared_all_the_same() -> None:
    unsized = bench(64, 300.0) | {"mean_batch_size": None}  # what bench reports for such a server
    result = compare(LIMIT, [("rival", unsized, None), ("rival", unsized, None), ("ours", bench(64, 330.0), None)])
    rows = {row["variant"]: row for row in result["variants"]}
    assert rows["rival"]["mean_batch_size"] is None and rows["ours"]["mean_batch_size"] is not None
    assert "| rival | 300.0 (300, 300) | 0.75 (0.75, 0.75) | 5.000 | 0.90 | - |" in compare_markdown(result)


RAISED = {"limit": {"images_per_s": 500.0, "cpu_ms_per_image": 6.0, "best_batch": 16, "every_core_images_per_s": 600.0}}


def test_compare_takes_a_limit_as_the_report_does_raised_to_what_every_core_served() -> None:
    result = compare(RAISED, [("a", bench(64, 300.0, 4.0), None)])
    row = result["variants"][0]
    assert result["limit_images_per_s"] == 600.0 and result["limit_cpu_ms_per_image"] == 5.0  # 6.0 * 500 / 600
    assert row["ratio"] == 0.5 and row["cpu_ratio"] == 1.25
    report = build_report(RAISED, [bench(64, 300.0, 4.0)], None, {})
    assert (row["ratio"], row["cpu_ratio"]) == (report["saturation"]["ratio"], report["saturation"]["cpu_ratio"])
    assert "(the formula read 500.0; raised to what every core served" in compare_markdown(result)
    # a round's own limit likewise: the threads' run served more than the formula there
    slow = {"limit": {**RAISED["limit"], "images_per_s": 300.0, "every_core_images_per_s": 280.0}}
    slow["limit"]["every_thread_images_per_s"] = 400.0
    rounds = compare(RAISED, [("a", bench(64, 300.0), RAISED), ("a", bench(64, 300.0), slow)])
    assert rounds["round_limits"] == [600.0, 400.0] and rounds["round_limits_formula"] == [500.0, 300.0]
    assert rounds["variants"][0]["ratios"] == [0.5, 0.75]


def test_each_round_is_divided_by_its_own_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = {"limit": {"images_per_s": 300.0, "cpu_ms_per_image": 6.0, "best_batch": 16}}
    files = {"limit.json": LIMIT, "r1.json": LIMIT, "r2.json": slow}
    files |= {"a1.json": bench(64, 320.0), "a2.json": bench(64, 270.0)}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    runs = [f"a={tmp_path / 'a1.json'}@{tmp_path / 'r1.json'}", f"a={tmp_path / 'a2.json'}@{tmp_path / 'r2.json'}"]
    args = ["compare", "--limit", str(tmp_path / "limit.json"), "--run", *runs, "--out-json", str(tmp_path / "c.json")]
    assert cli.main(args) == 0
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["round_limits"] == [400.0, 300.0]
    assert result["variants"][0]["ratios"] == [0.8, 0.9] and result["variants"][0]["ratio"] == 0.85
    assert "per round: 400, 300" in capsys.readouterr().out


def test_the_report_command_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "limit.json").write_text(json.dumps(LIMIT))
    (tmp_path / "b.json").write_text(json.dumps(bench(32, 200.0)))
    args = ["report", "--limit", str(tmp_path / "limit.json"), "--bench", str(tmp_path / "b.json")]
    args += ["--out-json", str(tmp_path / "r.json"), "--out-md", str(tmp_path / "r.md")]
    assert cli.main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["saturation"]["ratio"] == 0.5
    assert (tmp_path / "r.md").read_text().startswith("## service / limit: 0.50")


def test_a_limit_measured_again_after_the_service_is_averaged_in() -> None:
    after = {"limit": {"images_per_s": 360.0, "cpu_ms_per_image": 5.5, "best_batch": 16}}
    report = build_report(LIMIT, [bench(64, 340.0)], None, {}, limit_after=after)
    assert report["limit_images_per_s"] == 380.0 and report["limit_runs_images_per_s"] == [400.0, 360.0]
    assert report["saturation"]["ratio"] == round(340 / 380, 4)
    assert "measured 400.0 and 360.0" in markdown(report)


def test_the_every_core_ceiling_gives_a_second_ratio_when_the_limit_measured_it() -> None:
    before = {"limit": {**LIMIT["limit"], "every_core_images_per_s": 320.0}}
    after = {"limit": {**LIMIT["limit"], "every_core_images_per_s": 360.0}}
    report = build_report(before, [bench(64, 306.0)], None, {}, limit_after=after)
    assert report["every_core_images_per_s"] == 340.0 and report["every_core_runs_images_per_s"] == [320.0, 360.0]
    assert report["saturation"]["every_core_ratio"] == 0.9 and report["saturation"]["ratio"] == 0.765
    assert "0.85 of the limit); **service / every core: 0.90**" in markdown(report)
    assert "every_core_ratio" not in build_report(LIMIT, [bench(64, 306.0)], None, {})["saturation"]


def test_every_core_in_one_process_gives_a_third_ratio_and_what_the_services_core_keeps_of_it() -> None:
    def limit(processes: float, threads: float) -> dict[str, Any]:
        return {"limit": {**LIMIT["limit"], "every_core_images_per_s": processes, "every_thread_images_per_s": threads}}

    core = {"concurrency": 64, "throughput_rps": 270.0, "mean_batch_size": 16.0, "errors": {}}
    core["cpu"] = {"cores": 1.9, "ms_per_request": 5.1, "threads_ms_per_request": {"device": 2.6}}
    report = build_report(limit(350.0, 330.0), [bench(64, 255.0)], None, {}, core=core, limit_after=limit(350.0, 350.0))
    assert report["every_thread_images_per_s"] == 340.0 and report["every_thread_runs_images_per_s"] == [330.0, 350.0]
    assert report["saturation"]["every_thread_ratio"] == 0.75 and report["saturation"]["every_core_ratio"] == 0.7286
    text = markdown(report)
    assert "a thread per core sharing the GIL: 340.0 images/s (0.85 of the limit, 0.97 of the processes')" in text
    assert "**service / every core in one process: 0.75**, its core with no HTTP 0.79" in text
    order = [text.index(part) for part in ("service / every core:", "every core in one process", "no HTTP in front")]
    assert order == sorted(order)
    threads_only = {"limit": {**LIMIT["limit"], "every_thread_images_per_s": 300.0}}
    alone = build_report(threads_only, [bench(64, 255.0)], None, {})
    assert "(0.75 of the limit); **service / every core in one process: 0.85**" in markdown(alone)
    assert "every_thread_ratio" not in build_report(LIMIT, [bench(64, 255.0)], None, {})["saturation"]


def test_the_service_with_no_http_gives_what_the_http_layer_keeps(tmp_path: Path) -> None:
    core = {
        "concurrency": 64,
        "throughput_rps": 340.0,
        "mean_batch_size": 16.0,
        "errors": {},
        "cpu": {"cores": 1.9, "ms_per_request": 5.1, "threads_ms_per_request": {"device": 2.6, "event loop": 0.25}},
    }
    report = build_report(LIMIT, [bench(64, 306.0)], None, {}, core=core)
    assert report["core_ratio"] == 0.85 and report["saturation"]["http_ratio"] == 0.9
    text = markdown(report)
    assert "340.0 requests/s (0.85 of the limit), 5.100 ms CPU per request (device 2.60, event loop 0.25)" in text
    assert "**service / no HTTP: 0.90**" in text
    assert "http_ratio" not in build_report(LIMIT, [bench(64, 306.0)], None, {})["saturation"]
    # and through the command, from ai-backend core's JSON report
    for name, content in {"limit.json": LIMIT, "b.json": bench(64, 306.0), "core.json": core}.items():
        (tmp_path / name).write_text(json.dumps(content))
    args = ["report", "--limit", str(tmp_path / "limit.json"), "--bench", str(tmp_path / "b.json")]
    assert cli.main([*args, "--core", str(tmp_path / "core.json"), "--out-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["saturation"]["http_ratio"] == 0.9


def test_the_least_http_possible_gives_what_http_and_the_layers_on_it_keep() -> None:
    floor = bench(64, 360.0, 4.8)
    report = build_report(LIMIT, [bench(64, 306.0)], None, {}, floor=floor)
    assert report["floor_ratio"] == 0.9 and report["saturation"]["floor_http_ratio"] == 0.85
    assert report["floor"] == {"throughput_rps": 360.0, "cpu": floor["cpu"], "errors": {}}
    text = markdown(report)
    assert "360.0 requests/s (0.90 of the limit), 4.800 ms CPU per request; **service / least HTTP: 0.85**" in text
    assert "floor_http_ratio" not in build_report(LIMIT, [bench(64, 306.0)], None, {})["saturation"]
    failed = build_report(LIMIT, [bench(64, 306.0)], None, {}, floor={**floor, "errors": {"transport": 3}})
    assert "errors {'transport': 3}; **service / least HTTP" in markdown(failed)
