"""Rotary position embedding, half-split (NeoX / Hugging Face) convention.

GGUF q/k rows are un-permuted at load (engine/checkpoints/gguf.py), so every source uses this one convention.
`inv_freq` already holds any frequency scaling (Llama-3 rope_freqs / rope_scaling): [D/2] for every token, or
[T, D/2], a row per token (LongRoPE's factors differ with the position).
"""

import torch

from llamaterm.kernels.attention import write_kv
from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.norm import rms_norm
from llamaterm.kernels.ops_cpu import native_lib, rope_cpu


def rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, qk_norm=None, eps=0.0) -> torch.Tensor:
    """q [T, Hq, D], k, v [T, Hk, D], positions [T], inv_freq [D/2] or [T, D/2]: returns the rotated q, and writes
    the rotated k and v to the cache at slot_mapping (kernels/attention.py's write_kv). qk_norm: the weights
    (q's, k's) of an RMSNorm per head, applied first (Qwen3, Gemma 3). On CUDA one kernel does all of it."""
    if use_triton(q):
        from llamaterm.kernels.rope_triton import rope_write_kv_triton

        return rope_write_kv_triton(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping, qk_norm, eps)
    if qk_norm is not None:
        (q, _), (k, _) = rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)
    q, k = rope_cpu(q, k, positions, inv_freq, lib) if (lib := native_lib(q)) else rope_ref(q, k, positions, inv_freq)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


def rope_ref(q, k, positions, inv_freq):
    freqs = positions.float()[:, None] * inv_freq.float()  # [T, D/2]
    cos = freqs.cos()[:, None, :]
    sin = freqs.sin()[:, None, :]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
