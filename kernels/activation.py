"""The gated MLP's activation over the fused gate_up projection output: SiLU(gate) * up (SwiGLU: Llama, Qwen,
Phi) or GELU(gate) * up with GELU's tanh approximation (GeGLU: Gemma, transformers' gelu_pytorch_tanh)."""

import torch
import torch.nn.functional as F

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import gelu_tanh_and_mul_cpu, native_lib, silu_and_mul_cpu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from llamaterm.kernels.activation_triton import act_and_mul_triton

        return act_and_mul_triton(gate_up, "silu")
    if lib := native_lib(gate_up):
        return silu_and_mul_cpu(gate_up, lib)
    return silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        from llamaterm.kernels.activation_triton import act_and_mul_triton

        return act_and_mul_triton(gate_up, "gelu_tanh")
    if lib := native_lib(gate_up):
        return gelu_tanh_and_mul_cpu(gate_up, lib)
    return gelu_tanh_and_mul_ref(gate_up)


def silu_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
