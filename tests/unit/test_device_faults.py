"""What each library's error says of the device, as torch 2.14 (cuDNN 9) raises it: out of memory
(split, retry), a lost device (503, the CPU fallback), or a bug of ours (None: a 500)."""

from __future__ import annotations

import pytest

from app.inference.device import Fault, device_fault, fault_line

# torch's TORCH_CUDABLAS_CHECK puts "CUDA error: " before every cuBLAS status
GEMM = "when calling `cublasGemmStridedBatchedEx(handle, opa, opb, m, n, k, &falpha, a, CUDA_R_16F, lda, ...)`"
SCRIPTED = (
    "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent call last):"
)


@pytest.mark.parametrize(
    ("message", "fault"),
    [
        # cuDNN 9 names its failed allocations internal errors: out of memory all the same
        ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED", Fault.MEMORY),
        ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", Fault.MEMORY),
        (f"{SCRIPTED}\nRuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", Fault.MEMORY),
        ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", Fault.MEMORY),  # cuDNN 8
        ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR", Fault.DEVICE),
        ("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED", Fault.DEVICE),
        ("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED_CUDART", Fault.DEVICE),
        # cuBLAS, with the prefix torch gives it: a status about the call's arguments is a bug of ours
        (f"CUDA error: CUBLAS_STATUS_NOT_SUPPORTED {GEMM}", None),
        (f"CUDA error: CUBLAS_STATUS_INVALID_VALUE {GEMM}", None),
        (f"CUDA error: CUBLAS_STATUS_ARCH_MISMATCH {GEMM}", None),
        (f"{SCRIPTED}\nRuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED {GEMM}", None),
        # its failed allocation stays out of memory, its failed execution a lost device
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", Fault.MEMORY),
        (f"CUDA error: CUBLAS_STATUS_EXECUTION_FAILED {GEMM}", Fault.DEVICE),
        (f"CUDA error: CUBLAS_STATUS_INTERNAL_ERROR {GEMM}", Fault.DEVICE),
        ("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`", Fault.DEVICE),
        # cuDNN's statuses about the call (cuDNN 9 adds the reason)
        ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED_SHAPE", None),
        ("cuDNN error: CUDNN_STATUS_BAD_PARAM_NULL_POINTER", None),
        ("CUDA error: an illegal memory access was encountered", Fault.DEVICE),
    ],
)
def test_each_library_status_is_told_as_what_it_says_of_the_device(message: str, fault: Fault | None) -> None:
    assert device_fault(RuntimeError(message)) is fault


def test_the_line_told_of_a_cudnn_9_allocation_failure_is_its_status() -> None:
    status = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"
    assert fault_line(RuntimeError(f"{SCRIPTED}\n  x = conv(x)\n{status}")) == status
