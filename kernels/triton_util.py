"""Small helpers shared by the Triton kernels."""

import functools
import os

import torch
import triton
import triton.language as tl

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def arith_dtype(dtype: torch.dtype) -> tl.dtype:
    """Dtype for packed arithmetic and tl.dot operands on `dtype` values: the dtype itself, except bf16 under
    TRITON_INTERPRET, whose bf16 add/mul/dot act on the bit patterns as integers (triton 3.9). fp32 holds every
    bf16 value exactly, so the CPU tests check the same algorithm."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _TL_DTYPE[dtype]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU tensors the Triton interpreter runs on."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (Hopper on): the next kernel in the
    stream, or in a CUDA graph, is launched while this one runs and waits in `after_previous` for it to end, so its
    launch and prologue overlap the tail of the one before (a decode step is some 300 kernels of a few
    microseconds). LLAMATERM_PDL=0 turns it off."""
    return (
        device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("LLAMATERM_PDL", "1") != "0"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


@functools.cache
def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A launch's arguments for `pdl`: the kernel's PDL (which after_previous reads) and Triton's launch_pdl."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def after_previous(PDL: tl.constexpr):
    """A kernel's first step under programmatic dependent launch: wait until the kernel before it has ended and
    its writes are visible (nothing is read or written before), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
