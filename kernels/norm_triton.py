"""RMSNorm fused with the residual add, on CUDA: one program per row, one read of x (and residual), one write of
the normalized row (and of the sum). With X_NORM, x itself is normalized first (Gemma's post-norm of a sublayer's
output), so a post-norm costs no launch of its own. Rounding follows the reference: each normalized row is rounded
to the activation dtype before its weight multiplies it, the product and the sum again."""

import torch
import triton
import triton.language as tl

from llamaterm.kernels.triton_util import after_previous, pdl_launch


@triton.jit
def _normalize(x, w_ptr, c, mask, n_cols, eps):
    """norm(x) * w in fp32, rounded as the reference rounds it (x holds the activation dtype)."""
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    return (xf * inv_rms).to(x.dtype).to(tl.float32) * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    xw_ptr,
    y_ptr,
    sum_ptr,
    n_cols,
    eps,
    stride_x,
    stride_res,
    stride_y,
    stride_sum,
    HAS_RESIDUAL: tl.constexpr,
    X_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if X_NORM:
        x = _normalize(x, xw_ptr, c, mask, n_cols, eps).to(x.dtype)
    if HAS_RESIDUAL:
        x = x.to(tl.float32) + tl.load(res_ptr + row * stride_res + c, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + c, x, mask=mask)
    y = _normalize(x, w_ptr, c, mask, n_cols, eps)
    tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, x_weight: torch.Tensor | None
):
    """kernels/norm.py's rms_norm on CUDA, which gives every argument."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = x
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, n_cols)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        total = torch.empty_like(x2)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            weight if x_weight is None else x_weight,
            y,
            total if residual is not None else y,
            n_cols,
            eps,
            x2.stride(0),
            res2.stride(0),
            y.stride(0),
            total.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None,
            X_NORM=x_weight is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            **pdl_launch(x.device),
        )
    return y.view(*x.shape[:-1], n_cols), total.view(x.shape)
