"""The gated MLP's activation over the fused gate_up projection output: SiLU(gate) * up (SwiGLU: Llama, Qwen,
Phi), GELU(gate) * up with GELU's tanh approximation (GeGLU: Gemma, transformers' gelu_pytorch_tanh), or gpt-oss's
clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate) with gate <= 7 and -7 <= up <= 7 ("swiglu_oai")."""

import torch
import torch.nn.functional as F

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import act_and_mul_cpu, native_lib


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[..., 2I] -> [..., I]; activation: one of ACTIVATIONS."""
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


# gpt-oss's SwiGLU (transformers' GptOssExperts): its alpha and the limit it clamps gate and up to
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def swiglu_oai_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=SWIGLU_OAI_LIMIT), up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA)


REFERENCES = {"silu": silu_and_mul_ref, "gelu_tanh": gelu_tanh_and_mul_ref, "swiglu_oai": swiglu_oai_and_mul_ref}
ACTIVATIONS = tuple(REFERENCES)
