"""The gated activations on CUDA, reading the fused gate_up output once: [..., 2I] -> [..., I]. SiLU(g) = g *
sigmoid(g); GELU's tanh form is g * (1 + tanh(z)) / 2 = g * sigmoid(2z), z = sqrt(2/pi) * (g + 0.044715 g^3)."""

import torch
import triton
import triton.language as tl

from llamaterm.kernels.triton_util import after_previous, pdl_launch

BLOCK = 1024
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a compiled kernel reads only constexpr globals


@triton.jit
def gated(gate, up, GELU: tl.constexpr):
    """act(gate) * up in fp32 (SiLU, or with GELU its tanh form)."""
    if GELU:
        z = 2.0 * SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    else:
        z = gate
    return gate / (1.0 + tl.exp(-z)) * up


@triton.jit
def _act_and_mul_kernel(
    x_ptr, y_ptr, n_cols, stride_x, stride_y, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n_cols
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, gated(gate, up, GELU).to(y_ptr.dtype.element_ty), mask=mask)


def act_and_mul_triton(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation: "silu" or "gelu_tanh"."""
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
            GELU=activation == "gelu_tanh",
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_launch(x.device),
        )
    return y.view(*gate_up.shape[:-1], n_cols)
