"""RMSNorm, optionally fused with the residual add that precedes it, and with a norm of the added rows (Gemma's
post-norms: a sublayer's output is normalized before it joins the residual stream)."""

import torch

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import native_lib, rms_norm_cpu


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    x_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual); with no residual, the second is x. With x_weight
    (which needs a residual), x is first replaced by norm(x) * x_weight."""
    assert x_weight is None or residual is not None
    if use_triton(x):
        from llamaterm.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual, x_weight)
    if x_weight is not None:
        x, _ = rms_norm(x, x_weight, eps)
    if lib := native_lib(x):
        return rms_norm_cpu(x, weight, eps, residual, lib)
    return rms_norm_ref(x, weight, eps, residual)


def rms_norm_ref(x, weight, eps, residual=None, x_weight=None):
    if x_weight is not None:
        x, _ = rms_norm_ref(x, x_weight, eps)
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), x
