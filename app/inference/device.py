"""The device: which one, at what precision, its memory, and the threads that drive it.

All model work runs on dedicated threads, never on the event loop. A GPU gets one thread,
which serialises its work. A CPU can get several (``model.device_workers``), each running
whole batches with ``model.intra_op_threads`` cores, as an inference server runs several
model instances: with one, a single core does the forward passes while the others wait. On a
small CPU they decode their batches' images too (``server.decode``, ``plan_threads``).
"""

from __future__ import annotations

import enum
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from app.inference.workers import WorkerThreads

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DeviceMissing(RuntimeError):
    """``model.device`` names a device this machine does not have: a setting to change."""


def resolve_device(setting: str) -> torch.device:
    """``auto`` is ``cuda:0`` when CUDA works there, else the CPU; a device named that this
    machine does not have raises ``DeviceMissing``.

    Blocking: for ``auto`` on a machine with CUDA it makes the device's context (seconds), so
    call it off the event loop. ``torch.cuda.is_available()`` makes none: a GPU that another
    process holds in exclusive mode, or whose memory is full, passes it, and its first use fails.
    """
    if setting == "auto":
        return _working_cuda() or torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceMissing(f"model.device={setting} but CUDA is not available on this machine")
        if (count := torch.cuda.device_count()) <= (device.index or 0):
            raise DeviceMissing(
                f"model.device={setting} but this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def _working_cuda() -> torch.device | None:
    """``cuda:0`` if a tensor can be made and computed there; None (the CPU serves) if not, said why."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", 0)
    try:
        torch.ones(1, device=device).add_(1).cpu()  # the context made, memory taken, a kernel run
    except Exception as exc:  # "busy or unavailable" (exclusive mode), out of memory, a driver's error
        log.warning(
            "model.device=auto: CUDA is present but %s cannot be used (%s): serving from the CPU "
            "(model.device=cuda would fail start-up instead)",
            device,
            fault_line(exc),
        )
        return None
    return device


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``auto`` is fp16 on CUDA and fp32 on the CPU (where fp16 is 20-40x slower)."""
    if setting == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return _DTYPES[setting]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in _DTYPES.items() if value == dtype)


PRIMITIVE_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def size_primitive_cache(entries: int) -> str | None:
    """Give oneDNN's primitive cache ``entries`` (unless the environment already says); the capacity in force.

    On a CPU, torch runs convolutions through oneDNN, which builds (JIT-compiles) a primitive
    for each layer and input shape and keeps them in a cache of 1024 by default. A batcher
    runs every batch size from 1 to its max: mobilenet_v3_small has about 60 such layers, so
    24 sizes need some 1,400 entries, and at 1024 the cache evicts and rebuilds all the time.
    Measured in process on batches of mixed sizes: 3.6 against 2.6 ms per image, batches of
    two 11.3 against 4.5. oneDNN reads the variable when it first builds a primitive, so this
    must run before the first model does, and is process-wide.
    """
    if entries > 0:
        os.environ.setdefault(PRIMITIVE_CACHE_ENV, str(entries))
    return os.environ.get(PRIMITIVE_CACHE_ENV)


@dataclass(frozen=True)
class Threads:
    """How many batches run at once on the device (and how many more for urgent batches only),
    how many torch threads each uses, and how many threads decode images."""

    workers: int
    intra_op: int  # 0: torch's own default
    decode: int
    urgent: int = 0
    decode_in_batch: bool = False  # each batch's device thread decodes its images (``server.decode``)
    normal_nice: int = 10  # the normal batches' threads' nice offset, where urgent-only threads exist


def plan_threads(
    device: torch.device,
    workers: int,
    intra_op: int,
    decode: int,
    cores: int,
    urgent: int | None = None,
    decode_mode: str = "pool",
    normal_nice: int | None = None,
) -> Threads:
    """Resolve ``model.device_workers``, ``model.intra_op_threads``, ``server.preprocess_workers``
    (0 is automatic for each), ``model.urgent_workers`` and ``model.normal_nice`` (``None`` is
    automatic for each) and ``server.decode`` (``decode_mode``).

    A GPU gets one worker: it serialises device work. A CPU of two or more cores gets two
    (three on 2 cores where they decode too: see ``decode_mode`` below),
    and the cores are shared among them: on small models one batch cannot keep several
    cores busy (and OpenMP threads spin against the decode pool), while two batches at
    once keep every core on the forward pass. Decoding in a pool gets half the cores: more runnable
    threads than cores only trade CPU for context switches (measured on 2 cores: one decode
    thread beat two by 0.6 to 0.7 of the limit).

    A CPU of two or more cores also gets one thread for urgent batches only, and the normal
    workers run at a lower OS priority (``model.normal_nice``): an urgent batch then neither
    waits for a normal one to end nor shares its core with one. On 2 cores at 200 requests/s
    this took urgent p99 from 182-227 ms to 62-75 ms, with saturation unchanged. Without the
    lowered priority the third forward pass competed as an equal and cost throughput (0.54
    of the limit against 0.65). A GPU runs one batch at a time anyway: none there.

    On a GPU torch gets one thread: the host's share of a batch (stacking it, the copy) is
    small, and torch's default (a thread per core) spun them all: a device thread feeding an
    H200 kept 15.7 of 16 cores busy, and each decode thread's resize started its own team of
    16 (128 threads). Served on the H200 with one, 11-14% more requests a second. Once the CPU
    fallback serves, the device thread computes with the CPU's plan instead (``fallback_intra_op``).

    ``decode_mode`` ``auto`` decodes in the batch (``batch``) on a CPU whose device threads
    compute on one core each, and in the pool's threads elsewhere: a device thread with several
    torch threads would leave all but one idle while it decoded, and a GPU's would leave the GPU
    idle. Decoding in the batch, the device threads are one more than the cores (when not set):
    a thread waiting for the GIL between two images' decodes leaves its core to the extra one.
    On 2 cores three such threads served 1.029 times the pool's requests a second (0.991-1.071,
    6 alternated rounds), at 0.976 of its CPU a request; two, 0.984 (docs/performance.md,
    thirty-fifth pass). Their nice is then 2, not 10: all of the images' work runs at that
    priority, and at twice the load, refusals running on the event loop first, nice 10 answered
    0.920 of the pool's requests in time (5 rounds), nice 5 0.941, nice 2 0.998, each the same
    as the others at saturation (1.026 of the pool).
    """
    decode = decode or max(1, cores // 2)
    if device.type != "cpu":
        in_batch = decode_mode == "batch"
        return Threads(workers or 1, intra_op or 1, decode, urgent or 0, in_batch, _nice(normal_nice, in_batch))
    planned = workers or (2 if cores >= 2 else 1)
    intra_op = intra_op or max(1, cores // planned)
    in_batch = decode_mode == "batch" or (decode_mode == "auto" and intra_op == 1)
    if in_batch and not workers and intra_op == 1 and cores >= 2:
        planned = cores + 1
    urgent = (1 if cores >= 2 else 0) if urgent is None else urgent
    return Threads(planned, intra_op, decode, urgent, in_batch, _nice(normal_nice, in_batch))


def fallback_intra_op(threads: Threads, intra_op: int, cores: int) -> int:
    """The torch threads a batch gets once the CPU fallback serves: the CPU's plan (``intra_op``:
    ``model.intra_op_threads``) for ``cores``, with the device threads ``threads`` has. A GPU's
    plan gives its one device thread one torch thread: kept, the fallback would compute on one
    core of a machine whose other cores idle, and refuse most of its traffic."""
    return plan_threads(torch.device("cpu"), threads.workers, intra_op, threads.decode, cores).intra_op


def _nice(setting: int | None, decode_in_batch: bool) -> int:
    """``model.normal_nice``: as set, else 2 where the device threads decode, 10 where they do not."""
    return setting if setting is not None else 2 if decode_in_batch else 10


CGROUP_ROOT = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuLimit:
    """The CPUs this process may use, a fraction where a CPU quota sets it, and what set it."""

    cpus: float
    source: str


def _own_cgroups(own: Path) -> tuple[str, list[tuple[str, str]]]:
    """This process's cgroup v2 path and its v1 ``cpu`` controller's (mount folder, path) pairs,
    from ``/proc/self/cgroup``; the hierarchies' roots when it cannot be read."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        lines = []
    v2, v1 = "/", [("cpu", "/")]
    for line in lines:
        controllers, found, path = line.partition(":")[2].partition(":")  # "ID:CONTROLLERS:PATH"
        if not found:
            continue
        if not controllers:
            v2 = path or "/"
        elif "cpu" in controllers.split(","):  # mounted at cpu/ or at cpu,cpuacct/ (one a link to the other)
            v1 = list(dict.fromkeys([("cpu", path), (controllers, path)]))
    return v2, v1


def _upwards(base: Path, path: str) -> list[Path]:
    """``base/path`` and every folder above it up to ``base``: a parent's quota caps its children,
    and inside a container's cgroup namespace its own cgroup is the root it sees."""
    parts = [part for part in path.split("/") if part not in ("", ".", "..")]
    return [base.joinpath(*parts[:end]) for end in range(len(parts), -1, -1)]


def _quota_v2(folder: Path) -> CpuLimit | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if not quota.isdigit() or not period.isdigit() or int(quota) == 0 or int(period) == 0:
        return None  # "max": no quota
    return CpuLimit(int(quota) / int(period), f"cgroup v2 {folder / 'cpu.max'}: {quota} / {period}")


def _quota_v1(folder: Path) -> CpuLimit | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None  # -1: no quota
    return CpuLimit(quota / period, f"cgroup v1 {folder / 'cpu.cfs_quota_us'}: {quota} / {period}")


def cpu_limit(root: Path = CGROUP_ROOT, own: Path = OWN_CGROUP) -> CpuLimit:
    """The CPUs this process may use: the smallest of its affinity mask (e.g. a cpuset) and the
    CPU quotas of its cgroups (a container's CPU limit, which the mask does not show), v2
    (``cpu.max``) or v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), from the process's own
    cgroup (``/proc/self/cgroup``) up to the root. A quota is a share of time, so it may be a
    fraction: 1.5 CPUs is 1.5 CPU-seconds a second, spread over any number of threads."""
    try:
        found = CpuLimit(float(len(os.sched_getaffinity(0))), "affinity mask")
    except AttributeError:  # not on Linux
        found = CpuLimit(float(os.cpu_count() or 1), "os.cpu_count()")
    v2, v1 = _own_cgroups(own)
    quotas = [_quota_v2(folder) for folder in _upwards(root, v2)]
    quotas += [_quota_v1(folder) for mount, path in v1 for folder in _upwards(root / mount, path)]
    return min([found, *(quota for quota in quotas if quota is not None)], key=lambda limit: limit.cpus)


def cpu_cores(root: Path = CGROUP_ROOT, own: Path = OWN_CGROUP) -> int:
    """The cores to plan threads for: ``cpu_limit`` rounded up, at least 1. Threads come whole:
    on a quota of 1.5 CPUs two threads share the time, where one would leave half a CPU idle."""
    return max(1, math.ceil(cpu_limit(root, own).cpus))


@dataclass(frozen=True)
class Memory:
    """Free and total memory of the device (host RAM for the CPU), in bytes."""

    free: int
    total: int


def memory(device: torch.device) -> Memory:
    """Blocking: CUDA asks the driver, the CPU reads ``/proc/meminfo``."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Memory(free, total)
    fields: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields[key] = int(rest.split()[0]) * 1024
    return Memory(fields.get("MemAvailable", 0), fields.get("MemTotal", 0))


def release_memory(device: torch.device) -> None:
    """Blocking: cached device memory back to the driver (a no-op on the CPU). A lost CUDA
    context fails this too, and that must not stop a fallback or a shutdown."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        log.warning("could not release device memory: %s", str(exc).splitlines()[0])


class DeviceThread(WorkerThreads):
    """The device's worker threads (one by default): whole batches, loads and warm-ups."""

    def __init__(
        self,
        name: str = "device",
        workers: int = 1,
        urgent_workers: int = 0,
        normal_nice: int = 0,
        urgent_slice_ns: int = 0,
        urgent_pause_s: float = 0.0,
        pausable: int = 0,
    ) -> None:
        super().__init__(
            name,
            workers,
            urgent_workers,
            normal_nice,
            urgent_slice_ns=urgent_slice_ns,
            urgent_pause_s=urgent_pause_s,
            pausable=pausable,
        )


class Fault(enum.Enum):
    MEMORY = "out of memory"
    DEVICE = "device error"


def device_fault(exc: BaseException) -> Fault | None:
    """What a forward pass's error says of the device; None: not the device's (a bug, bad input).

    TorchScript re-raises an error from inside a graph as a plain ``RuntimeError`` carrying
    the original message, so CUDA's out-of-memory error from the scripted backbone is known
    by its text, as is the CPU allocator's (a plain ``RuntimeError`` everywhere), and the
    libraries' own: cuBLAS reports a failed allocation as ``CUBLAS_STATUS_ALLOC_FAILED``, cuDNN 9
    (which torch 2.14 ships) as ``CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED`` or
    ``..._DEVICE_ALLOCATION_FAILED`` (an internal error by name, so these are looked for first;
    cuDNN 8 said ``CUDNN_STATUS_ALLOC_FAILED``). A CUDA error (illegal address, launch failure,
    ECC) leaves the context unusable; so, as far as this server can tell, does any cuBLAS or
    cuDNN failing to execute, map or initialise, or failing inside (``INTERNAL_ERROR``). A status
    about the call's arguments (``NOT_SUPPORTED``, ``INVALID_VALUE``, ``ARCH_MISMATCH``,
    ``BAD_PARAM``: a shape or a dtype the library does not take) is a bug of ours, not the
    device's, although torch puts "CUDA error: " before every cuBLAS status it raises.
    """
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return Fault.MEMORY
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    # first: CUDA raises its failed allocations as AcceleratorError too ("CUDA error: out of
    # memory", cudaErrorMemoryAllocation), and those leave the context usable (split, retry)
    if any(sign in text for sign in _OUT_OF_MEMORY):
        return Fault.MEMORY
    if any(sign in text for sign in _BAD_CALLS):  # inside torch's "CUDA error: ": not a lost device
        return None
    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or any(sign in text for sign in _DEVICE_ERRORS):
        return Fault.DEVICE
    return None


def fault_line(exc: BaseException) -> str:
    """The line of a device error that says what happened (TorchScript's start with its own)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    return next((line.strip() for line in lines if any(sign in line for sign in _TELLING)), lines[0])


# "can't allocate memory": the CPU's allocator; the statuses: cuBLAS's and cuDNN's (8, then 9)
_OUT_OF_MEMORY = (
    "out of memory",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
)
# the statuses about the call's arguments (cuDNN 9 adds a reason after them: NOT_SUPPORTED_SHAPE,
# BAD_PARAM_NULL_POINTER): a shape, a dtype or a batch size, a bug of ours: no fallback
_BAD_CALLS = (
    "CUBLAS_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_INVALID_VALUE",
    "CUBLAS_STATUS_ARCH_MISMATCH",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_BAD_PARAM",
    "CUDNN_STATUS_ARCH_MISMATCH",
)
# the statuses that say the device or the library's state failed, not the call's arguments
_FAILED_STATES = ("EXECUTION_FAILED", "INTERNAL_ERROR", "MAPPING_ERROR", "NOT_INITIALIZED")
_DEVICE_ERRORS = ("CUDA error", *(f"{lib}_STATUS_{state}" for lib in ("CUBLAS", "CUDNN") for state in _FAILED_STATES))
_TELLING = _OUT_OF_MEMORY + _DEVICE_ERRORS
