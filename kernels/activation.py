"""The gated MLP's activation over the fused gate_up projection output: SiLU(gate) * up (SwiGLU: Llama, Qwen,
Phi) or GELU(gate) * up with GELU's tanh approximation (GeGLU: Gemma, transformers' gelu_pytorch_tanh)."""

import torch
import torch.nn.functional as F

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import act_and_mul_cpu, native_lib


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[..., 2I] -> [..., I]; activation: "silu" or "gelu_tanh"."""
    if use_triton(gate_up):
        from llamaterm.kernels.activation_triton import act_and_mul_triton

        return act_and_mul_triton(gate_up, activation)
    if lib := native_lib(gate_up):
        return act_and_mul_cpu(gate_up, activation, lib)
    return REFERENCES[activation](gate_up)


def silu_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


REFERENCES = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref}
