"""The gated activations on CUDA, reading the fused gate_up output once: [..., 2I] -> [..., I]. SiLU(g) = g *
sigmoid(g); GELU's tanh form is g * (1 + tanh(z)) / 2 = g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3);
gpt-oss's clamped SwiGLU is (clamp(u) + 1) * g * sigmoid(1.702 g) with g clamped above (kernels/activation.py)."""

import torch
import triton
import triton.language as tl

from llamaterm.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from llamaterm.kernels.triton_util import after_previous, pdl_launch

BLOCK = 1024
# a compiled kernel reads only constexpr globals
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)


@triton.jit
def gated(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32; ACTIVATION: one of kernels/activation.py's ACTIVATIONS."""
    if ACTIVATION == "swiglu_oai":
        gate = tl.minimum(gate, OAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -OAI_LIMIT), OAI_LIMIT) + 1.0
        z = OAI_ALPHA * gate
    elif ACTIVATION == "gelu_tanh":
        z = 2.0 * SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    else:
        z = gate
    return gate / (1.0 + tl.exp(-z)) * up


@triton.jit
def _act_and_mul_kernel(
    x_ptr, y_ptr, n_cols, stride_x, stride_y, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, gated(gate, up, ACTIVATION).to(y_ptr.dtype.element_ty), mask=mask)


def act_and_mul_triton(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation: one of kernels/activation.py's ACTIVATIONS."""
    n_cols = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * n_cols)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] > 0:
        _act_and_mul_kernel[(x.shape[0], triton.cdiv(n_cols, BLOCK))](
            x,
            y,
            n_cols,
            x.stride(0),
            y.stride(0),
            ACTIVATION=activation,
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_launch(x.device),
        )
    return y.view(*gate_up.shape[:-1], n_cols)
