"""y = x @ W^T for a dense tensor or a QuantWeight."""

import torch
import torch.nn.functional as F

from llamaterm.kernels.activation import act_and_mul
from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import native_lib, qmatmul_cpu
from llamaterm.kernels.qweight import QuantWeight


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if use_triton(x):
        from llamaterm.kernels.linear_triton import qmatmul_triton

        return qmatmul_triton(x, w)
    if w.group_size % 16 == 0 and w.shape[1] % 16 == 0 and (lib := native_lib(x)):
        return qmatmul_cpu(x, w, lib)
    return linear_ref(x, w)


def linear_act(x: torch.Tensor, w: torch.Tensor | QuantWeight, activation: str) -> torch.Tensor:
    """act_and_mul(linear(x, w), activation): w stacks a gated MLP's gate and up projections. On CUDA a quantized
    w takes one kernel: the matmul's epilogue applies the activation."""
    if isinstance(w, QuantWeight) and use_triton(x):
        from llamaterm.kernels.linear_triton import qmatmul_triton

        return qmatmul_triton(x, w, activation=activation)
    return act_and_mul(linear(x, w), activation)


def linear_ref(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    if w.perm is not None:
        x = x[..., w.perm]
    return F.linear(x, w.dense(x.dtype))
