"""SiLU(gate) * up over the fused gate_up projection output."""

import torch
import torch.nn.functional as F

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import native_lib, silu_and_mul_cpu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from llamaterm.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    if lib := native_lib(gate_up):
        return silu_and_mul_cpu(gate_up, lib)
    return silu_and_mul_ref(gate_up)


def silu_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
