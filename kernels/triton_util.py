"""Small helpers shared by the Triton kernels."""

import os

import torch
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
