"""Attention over the paged KV cache.

Layout: k_cache, v_cache are [num_blocks, block_size, n_kv_heads, head_dim]. A batch is a flat run of query
tokens: sequence b owns q[query_start_loc[b]:query_start_loc[b+1]], which are the last tokens of its context of
context_lens[b] tokens (their K/V already written to the cache); block_tables[b] lists its blocks in order.
Prefill chunks and decode steps (one query token) share this one description, so a step can mix them.
With a sliding window W, the query at position p sees keys p - W + 1 .. p only (as transformers' Mistral), and the
kernels read no key before the window of a sequence's first query in the step: the engine may have freed those
blocks (engine/serving/block_manager.py), and their block-table entries are then stale.
Attention sinks (gpt-oss): a learned logit per query head joins each row's softmax as one more key with no value,
so a row may give part of its weight to nothing: out = sum_j p_j v_j with p_j = exp(s_j) / (exp(sink) + sum exp(s)).
"""

import torch
import torch.nn.functional as F

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.ops_cpu import native_lib, paged_attention_cpu, write_kv_cpu


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store k, v [T, Hk, D] at flat cache slots (block * block_size + offset); slot -1 means skip. (On CUDA the
    rotary embedding's kernel writes the cache: kernels/rope.py.)"""
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
    if (lib := native_lib(k)) and k_cache.dtype == torch.float32 and contiguous:
        return write_kv_cpu(k, v, k_cache, v_cache, slot_mapping, lib)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    if slot_mapping.min() < 0:  # rare: drop the skipped tokens first (boolean indexing costs three more ops)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, window=None, sinks=None):
    """q [T, Hq, D] -> out [T, Hq, D], causal within each sequence (within `window` keys, if given), grouped-query
    aware; sinks: fp32 [Hq], a sink logit per head (None: no sinks)."""
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, window, sinks)
    if use_triton(q):
        from llamaterm.kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(*args)
    if (lib := native_lib(q)) and k_cache.dtype == torch.float32:
        return paged_attention_cpu(*args, lib)
    return paged_attention_ref(*args)


def paged_attention_ref(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, window=None, sinks=None
):
    out = torch.empty_like(q)
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // n_kv
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        lo = 0 if window is None else max(0, ctx - n - window + 1)  # the first key the first query sees
        first = lo // block_size
        blocks = block_tables[b, first : (ctx + block_size - 1) // block_size]
        keys = slice(lo - first * block_size, ctx - first * block_size)  # keys lo .. ctx - 1 of those blocks
        k = k_cache[blocks].flatten(0, 1)[keys].to(q.dtype).transpose(0, 1)  # [Hk, keys, D]
        v = v_cache[blocks].flatten(0, 1)[keys].to(q.dtype).transpose(0, 1)
        qb = q[s:e].transpose(0, 1)  # [Hq, n, D]
        mask = None
        if n > 1:  # query i sits at position ctx - n + i and sees keys 0 (or its window's first) .. ctx - n + i
            key_pos = torch.arange(lo, ctx, device=q.device)[None, :]
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
        if sinks is None:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        else:
            o = attention_with_sinks(qb, k, v, mask, scale, sinks)
        out[s:e] = o.transpose(0, 1)
    return out


def attention_with_sinks(q, k, v, mask, scale, sinks):
    """q [Hq, n, D], k and v [Hk, keys, D], mask [n, keys] or None; each head's sink logit joins the softmax."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q.float() @ k.float().transpose(1, 2)) * scale  # [Hq, n, keys]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (p @ v.float()).to(q.dtype)
