"""Rotary embedding of q and k in one launch on CUDA (half-split convention, see kernels/rope.py): one program
per token computes cos/sin once for all its heads. q and k may be strided views (of the fused qkv output);
the results are new contiguous tensors, as the reference returns. tl.cos / tl.sin lower to the precise libdevice
routines (not cos.approx), which matters: positions times inverse frequencies reach 1e5 radians."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src, dst, stride_h, n_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (i < HALF)
    x1 = tl.load(src + h * stride_h + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_h + HALF + i, mask=mask, other=0.0).to(tl.float32)
    out = dst + h * (2 * HALF) + i
    tl.store(out, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr, n_q_heads, n_k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_inv,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + t * stride_inv + i, mask=i < HALF, other=0.0).to(tl.float32)
    freq = tl.load(pos_ptr + t).to(tl.float32) * inv_freq
    cos = tl.cos(freq)[None, :]
    sin = tl.sin(freq)[None, :]
    _rotate(q_ptr + t * stride_qt, q_out_ptr + t * n_q_heads * 2 * HALF, stride_qh, n_q_heads, cos, sin,
            HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr + t * stride_kt, k_out_ptr + t * n_k_heads * 2 * HALF, stride_kh, n_k_heads, cos, sin,
            HALF, BLOCK_HK, BLOCK_HALF)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """inv_freq [D/2], or [T, D/2] with a row per token."""
    t, n_q, d = q.shape
    n_k = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and inv_freq.stride(-1) == 1
    q_out = torch.empty(t, n_q, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, n_k, d, dtype=k.dtype, device=k.device)
    if t > 0:
        _rope_kernel[(t,)](
            q, k, q_out, k_out, positions, inv_freq, n_q, n_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            inv_freq.stride(0) if inv_freq.dim() == 2 else 0,
            HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(n_k),
            BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4,
        )
    return q_out, k_out
