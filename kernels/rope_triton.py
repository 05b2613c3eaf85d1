"""Rotary embedding of q and k and the KV-cache write, in one launch on CUDA (half-split convention, see
kernels/rope.py; cache layout, kernels/attention.py): a program per token and KV head returns the rotated query
heads of its group and stores the rotated k and the v at the token's cache slot (slot -1: no write), so k never
makes a round trip through memory. q, k, v may be strided views (of the fused qkv output). tl.cos / tl.sin
lower to the precise libdevice routines (not cos.approx), which matters: positions times inverse frequencies reach
1e5 radians. With QK_NORM each q and k head is first RMS-normalized with its weight (Qwen3's and Gemma 3's q/k
norms), as kernels/norm.py rounds it. Rounding follows the references: the rotation in fp32, then one cast to the
cache's dtype."""

import torch
import triton
import triton.language as tl

from llamaterm.kernels.triton_util import after_previous, pdl_launch


@triton.jit
def _rotate(
    src,
    dst,
    stride_src,
    stride_dst,
    n_heads,
    cos,
    sin,
    norm_w,
    eps,
    QK_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (i < HALF)
    x1 = tl.load(src + h * stride_src + i, mask=mask, other=0.0)
    x2 = tl.load(src + h * stride_src + HALF + i, mask=mask, other=0.0)
    if QK_NORM:  # rounded as kernels/norm.py: the normalized head, then its product with the weight
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_w + i, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = ((x1f * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((x2f * inv_rms).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    out = dst + h * stride_dst + i
    tl.store(out, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    pos_ptr,
    slot_ptr,
    inv_freq_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_inv,
    stride_cb,
    stride_cs,
    stride_ch,
    QK_NORM: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)  # this program's KV head and the GROUP query heads that share it
    i = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + t * stride_inv + i, mask=i < HALF, other=0.0).to(tl.float32)
    freq = tl.load(pos_ptr + t).to(tl.float32) * inv_freq
    cos = tl.cos(freq)[None, :]
    sin = tl.sin(freq)[None, :]
    q_head = kv * GROUP
    q_out = q_out_ptr + (t * tl.num_programs(1) * GROUP + q_head) * 2 * HALF
    _rotate(
        q_ptr + t * stride_qt + q_head * stride_qh,
        q_out,
        stride_qh,
        2 * HALF,
        GROUP,
        cos,
        sin,
        q_norm_ptr,
        eps,
        QK_NORM,
        HALF,
        BLOCK_G,
        BLOCK_HALF,
    )
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        at = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kv * stride_ch
        _rotate(
            k_ptr + t * stride_kt + kv * stride_kh,
            k_cache_ptr + at,
            0,
            0,
            1,
            cos,
            sin,
            k_norm_ptr,
            eps,
            QK_NORM,
            HALF,
            1,
            BLOCK_HALF,
        )
        d = tl.arange(0, 2 * BLOCK_HALF)
        v = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=d < 2 * HALF)
        tl.store(v_cache_ptr + at + d, v.to(v_cache_ptr.dtype.element_ty), mask=d < 2 * HALF)


def rope_write_kv_triton(
    q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, qk_norm=None, eps=0.0
) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hk, D] -> rotated q (contiguous); rotated k and v into the caches at the slots.
    inv_freq [D/2], or [T, D/2] with a row per token; qk_norm: (q weight, k weight) [D] each, or None. A program
    per token and KV head: at one token the heads still spread over many SMs."""
    t, n_q, d = q.shape
    n_k = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and inv_freq.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    q_out = torch.empty(t, n_q, d, dtype=q.dtype, device=q.device)
    if t > 0:
        _rope_write_kv_kernel[(t, n_k)](
            q,
            k,
            v,
            q_out,
            k_cache,
            v_cache,
            positions,
            slot_mapping,
            inv_freq,
            *(qk_norm or (inv_freq, inv_freq)),
            eps,  # without norms, any pointer: QK_NORM compiles them out
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            inv_freq.stride(0) if inv_freq.dim() == 2 else 0,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            QK_NORM=qk_norm is not None,
            GROUP=n_q // n_k,
            HALF=d // 2,
            PAGE=k_cache.shape[1],
            BLOCK_G=triton.next_power_of_2(n_q // n_k),
            BLOCK_HALF=triton.next_power_of_2(d // 2),
            num_warps=1,
            **pdl_launch(q.device),
        )
    return q_out
