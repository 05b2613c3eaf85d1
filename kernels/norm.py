"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import native_lib, rms_norm_cpu


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); with no residual, the second is x."""
    if use_triton(x):
        from llamaterm.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    if lib := native_lib(x):
        return rms_norm_cpu(x, weight, eps, residual, lib)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), x
