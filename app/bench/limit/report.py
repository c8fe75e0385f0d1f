"""The limit from the measured costs, for the CPUs this process may use, and its markdown summary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from app.bench.limit.measure import DecodeCost, ForwardCost
from app.inference.device import CpuLimit, cpu_limit

SERVE_BATCH_TOLERANCE = 1.05  # the serving batch: the largest whose CPU per image is within 5% of the best


def cores() -> float:
    """The CPUs this process may use, as the service counts them: its affinity mask, capped
    by a container's CPU quota (counting the mask alone doubled a limit in a 2-core container
    on a 4-CPU node, and halved its ratio). A fraction stays one: a quota of 1.5 CPUs does 1.5
    CPUs' worth of images, where the service, planning whole threads, counts 2 (``cpu_cores``)."""
    return cpu_limit().cpus


def limit_report(
    decode: DecodeCost, forward_one: Sequence[ForwardCost], forward_default: Sequence[ForwardCost], cpus: CpuLimit
) -> dict[str, Any]:
    """The limit from the measured costs: the best batch (one torch thread) plus decode, for
    the CPUs the process may use (``cpus``, a fraction under a CPU quota; the report says what set it)."""
    best = min(forward_one, key=lambda r: r.cpu_ms_per_image)
    per_image_ms = decode.total_ms + best.cpu_ms_per_image
    # past the knee the curve is flat within the host's noise, and which size measures best
    # is luck; the largest one within SERVE_BATCH_TOLERANCE of the best serves with the fewest batches
    near = [r.batch_size for r in forward_one if r.cpu_ms_per_image <= best.cpu_ms_per_image * SERVE_BATCH_TOLERANCE]
    return {
        "cores": round(cpus.cpus, 3),
        "cores_from": cpus.source,
        "decode_cpu_ms": decode.total_ms,
        "forward_cpu_ms": best.cpu_ms_per_image,
        "best_batch": best.batch_size,
        "serve_batch": max(near),
        "cpu_ms_per_image": round(per_image_ms, 4),
        "images_per_s": round(cpus.cpus / (per_image_ms / 1000), 1),
        "formula": "cores (the CPUs the process may use, fractional) / "
        "(decode_cpu_s + forward_cpu_s at the best batch, 1 torch thread)",
        "decode": asdict(decode),
        "forward_1_thread": [asdict(r) for r in forward_one],
        "forward_default_threads": [asdict(r) for r in forward_default],
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown summary."""
    limit, decode = report["limit"], report["limit"]["decode"]
    lines = [
        f"## limit: {report['model']} v{report['version']}, {report['images']['count']} images "
        f"{report['images']['width']}x{report['images']['height']} "
        f"(mean {report['images']['mean_bytes'] / 1024:.0f} KiB), {limit['cores']:g} cores ({limit['cores_from']})",
        "",
        f"- decode (base64 + preprocess.decode, one thread): {decode['total_ms']:.3f} ms CPU per image "
        f"(base64 {decode['base64_ms']:.3f}, decode {decode['decode_ms']:.3f})",
        f"- forward at the best batch ({limit['best_batch']}, one torch thread): "
        f"{limit['forward_cpu_ms']:.3f} ms CPU per image; the largest batch within 5% of it: {limit['serve_batch']}",
        f"- **limit: {limit['images_per_s']:.1f} images/s** = {limit['cores']:g} / {limit['cpu_ms_per_image']:.3f} ms",
        "",
        "| batch | 1 thread: CPU ms/img | 1 thread: wall ms/img | "
        f"{report['host']['torch_default_threads']} threads: CPU ms/img | wall ms/img |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    default = {r["batch_size"]: r for r in limit["forward_default_threads"]}
    for row in limit["forward_1_thread"]:
        other = default.get(row["batch_size"])
        tail = f"{other['cpu_ms_per_image']:.3f} | {other['wall_ms_per_image']:.3f}" if other else "- | -"
        lines.append(
            f"| {row['batch_size']} | {row['cpu_ms_per_image']:.3f} | {row['wall_ms_per_image']:.3f} | {tail} |"
        )
    if every := report.get("every_core"):
        lines.append(
            f"\nevery core at once, no serving layer ({every['processes']} processes, each decoding and running "
            f"batches of {every['batch_size']}): {every['images_per_s']:.1f} images/s = "
            f"{every['images_per_s'] / limit['images_per_s']:.2f} of the limit"
        )
    if threads := report.get("every_thread"):
        lines.append(
            f"\nevery core at once in one process ({threads['threads']} threads sharing the GIL at a "
            f"{threads['switch_interval_ms']:g} ms switch interval, each decoding and running batches of "
            f"{threads['batch_size']}): {threads['images_per_s']:.1f} images/s = "
            f"{threads['images_per_s'] / limit['images_per_s']:.2f} of the limit"
        )
    for run in report.get("pipeline", []):
        lines.append(
            f"\npipelined in process ({run['decode_threads']} decode threads + 1 forward thread, batch "
            f"{run['batch_size']}): {run['images_per_s']:.1f} images/s = "
            f"{run['images_per_s'] / limit['images_per_s']:.2f} of the limit"
        )
    return "\n".join(lines)
