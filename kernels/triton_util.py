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


_counters: dict[tuple[torch.device, str], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # counters replaced by larger ones: CUDA graphs captured before still use them


def split_counters(device: torch.device, n: int, kernel: str) -> torch.Tensor:
    """int32 counters, zero between launches, for a kernel whose programs split a reduction: each program adds one
    to its tile's counter after storing its partial, and the last to arrive reduces and resets the counter. One
    set per kernel and device (one stream runs them: the engine's)."""
    c = _counters.get((device, kernel))
    if c is None or c.numel() < n:
        if c is not None:
            _outgrown.append(c)
        c = _counters[device, kernel] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return c


@triton.jit
def last_to_arrive(counter, n):
    """A program's arrival at its tile's split counter (split_counters), once its partial is stored: True for the
    last of the n, which then reduces the partials and resets the counter to zero."""
    tl.debug_barrier()  # every thread's partial is stored before the counter's release
    return tl.atomic_add(counter, 1, sem="acq_rel") == n - 1


@functools.cache
def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (Hopper on): the next kernel in the
    stream, or in a CUDA graph, is launched while this one runs and waits in `wait_previous` for it to end, so its
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
    """A launch's arguments for `pdl`: the kernel's PDL (which wait_previous and launch_next read) and Triton's
    launch_pdl."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the kernel before has ended and its writes are visible
    (nothing may be read or written before)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Under programmatic dependent launch: let the next kernel launch once every program of this one has called
    this (or ended). Its programs then take SM slots and wait in wait_previous, so a kernel of more programs
    than fit at once calls it after its main loop: called first, the next kernel's waiting programs presumably took
    slots that this one's later programs wanted (Llama-3-8B shapes, one session on the H200: the decode graph
    1.920 ms with the matmul and the attention calling it after their loops, 2.074 ms with every kernel calling it
    first)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def after_previous(PDL: tl.constexpr):
    """A small kernel's first step: wait for the kernel before, then let the next launch."""
    wait_previous(PDL)
    launch_next(PDL)
