"""Paged attention on CUDA (layouts and semantics in kernels/attention.py; the KV-cache writes are the rotary
embedding's kernel's, kernels/rope_triton.py).

One kernel serves decode and chunked prefill. A program owns one KV head and a block of query rows: BLOCK_Q
consecutive query tokens of one sequence times the GROUP query heads that share the KV head, so every K/V tile
is read once for all of them (GQA). Query blocks of all sequences are numbered in one grid axis: sequence b's
blocks start at query_start_loc[b] // BLOCK_Q + b, which leaves room for its partial first and last block, and a
program finds its sequence by binary search, so varlen batches need no host-side metadata (and no sync).

Decode-heavy steps (about one query token per sequence) use BLOCK_Q = 1; when that grid is too small to fill
the GPU, the KV range is also split across programs (flash-decoding): each split with keys writes its normalized
partial output and log-sum-exp, and the last of them to finish (a counter per query block and KV head) merges
them, so a decode step's attention is one launch. The split count comes from the block table's width,
an upper bound on context length known on the host; each sequence's keys are shared among the splits in the
kernel, so a batch of short sequences (or a CUDA graph captured for the longest context) splits their real length.
With a sliding window (SLIDING) a program's keys start at its first query's window, so a long context costs
only the window, and blocks before it (possibly freed) are never read.
Attention sinks (SINKS): a row's online softmax starts from its head's sink, a key of logit `sink` and no value
(running max = sink, sum = 1, output 0), in split 0 only, so it is counted once and the merge is unchanged.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llamaterm.kernels import triton_util
from llamaterm.kernels.triton_util import last_to_arrive, launch_next, wait_previous

LOG2E = tl.constexpr(1.4426950408889634)  # a compiled kernel reads only constexpr globals


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_ptr,
    sinks_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    counters_ptr,
    qk_scale,
    window,
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    SINKS: tl.constexpr,
    DT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # the sequence of this query block: the last b whose first block index is <= pid
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q
        if BLOCK_Q > 1:
            first += mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_start
    first = q_start // BLOCK_Q
    if BLOCK_Q > 1:
        first += seq
    i0 = (pid - first) * BLOCK_Q  # first query of this block, counted within the sequence
    if i0 < n_q:
        ctx = tl.load(context_lens_ptr + seq)
        r = tl.arange(0, BLOCK_M)
        qi = i0 + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_mask = (r < BLOCK_Q * GROUP) & (qi < n_q)
        pos = ctx - n_q + qi  # query qi sits at position pos and sees keys 0..pos (SLIDING: pos - window + 1..pos)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )

        kv_end = ctx - n_q + tl.minimum(i0 + BLOCK_Q, n_q)  # one past the last key any row of the block sees
        kv_start = 0  # the first key any row sees: its first row's window start
        if SLIDING:
            kv_start = tl.maximum(ctx - n_q + i0 - window + 1, 0)
        # splits share this sequence's own keys (not the batch's longest): whole BLOCK_N steps each
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_lo = kv_start + split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
        n_used = tl.cdiv(kv_end - kv_start, per_split)  # splits with keys (every row sees each of their keys)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        if SINKS:  # the sink as the row's first key (log2 domain), in split 0 only
            sink = tl.load(sinks_ptr + head, mask=row_mask, other=float("-inf")) * LOG2E
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # tl.cast, not seq.to(): mypy takes seq for an int (from lo = 0), where Triton traces a tensor
        table = block_tables_ptr + tl.cast(seq, tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_mask = t < kv_hi
            page = tl.load(table + t // PAGE, mask=t_mask, other=0).to(tl.int64)
            kv_off = page * stride_cb + (t % PAGE) * stride_cs + kv_head * stride_ch
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=t_mask[None, :] & d_mask[:, None], other=0.0)
            s = tl.dot(q.to(DT), k.to(DT)) * qk_scale  # log2 domain
            visible = t_mask[None, :] & (t[None, :] <= pos[:, None])
            if SLIDING:
                visible &= t[None, :] > pos[:, None] - window
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at zero
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DT), v.to(DT))
            m_i = m_new

        launch_next(PDL)  # only now: see triton_util.launch_next
        tok = q_start + qi
        out_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        out_mask = row_mask[:, None] & d_mask[None, :]
        if n_used == 1:  # all keys in split 0 (without SPLIT, the only one); the other splits have none
            if split == 0:
                tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        elif SPLIT:
            if split < n_used:
                # a normalized partial and its log2-sum-exp; the last split to finish merges them all
                row0 = tok.to(tl.int64) * tl.num_programs(1) * GROUP + head  # the rows' partials in split 0
                stride = num_tokens * tl.num_programs(1) * GROUP  # from one split's partials to the next's
                tl.store(part_lse_ptr + split * stride + row0, m_i + tl.log2(l_i), mask=row_mask)
                o_offs = row0[:, None] * HEAD_DIM + d[None, :]
                tl.store(part_o_ptr + split * stride * HEAD_DIM + o_offs, acc / l_i[:, None], mask=out_mask)
                counter = counters_ptr + pid * tl.num_programs(1) + kv_head
                if last_to_arrive(counter, n_used):
                    o = _merge_splits(
                        part_o_ptr + o_offs, part_lse_ptr + row0, stride, HEAD_DIM, row_mask, out_mask, n_used
                    )
                    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
                    tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _merge_splits(o_ptrs, lse_ptrs, stride, HEAD_DIM: tl.constexpr, row_mask, mask, n_used):
    """The outputs [rows, BLOCK_D] from the partials of splits 0 .. n_used - 1 (split s's at o_ptrs + s * stride *
    HEAD_DIM and lse_ptrs + s * stride): each weighs 2^lse, merged online. Loads bypass L1 (.cg): other programs
    wrote them."""
    m = tl.full([o_ptrs.shape[0]], float("-inf"), tl.float32)
    w_sum = tl.zeros([o_ptrs.shape[0]], tl.float32)
    o = tl.zeros(o_ptrs.shape, tl.float32)
    for s in range(n_used):
        lse = tl.load(lse_ptrs + s * stride, mask=row_mask, other=0.0, cache_modifier=".cg")
        part = tl.load(o_ptrs + s * stride * HEAD_DIM, mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        o = o * alpha[:, None] + w[:, None] * part
        w_sum = w_sum * alpha + w
        m = m_new
    return o / w_sum[:, None]


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # query tokens per program (1: decode layout)
    block_n: int  # keys per loop step
    num_warps: int
    num_stages: int
    splits: int  # programs sharing one query block's KV range (flash-decoding)


def pick_config(
    num_tokens: int, num_seqs: int, n_kv: int, group: int, head_dim: int, max_context: int, sms: int
) -> AttentionConfig:
    """Tiles from sweeps on an H200 (BENCHMARKS.md). Decode: with fewer programs than SMs, split the KV range so
    that about two programs run per SM, each over at least 256 keys (more splits add merge work; fewer leave
    bandwidth unused); below two programs per SM, 128-key steps (above, 64: more programs fit in shared memory)."""
    if num_tokens <= 2 * num_seqs:  # decode-heavy: one query token per program, its GROUP rows padded to 16
        programs = num_tokens * n_kv
        block_n = 128 if programs < 2 * sms and head_dim <= 128 else 64
        splits = min(triton.cdiv(2 * sms, programs), triton.cdiv(max_context, 256)) if programs < sms else 1
        return AttentionConfig(1, block_n, 4, 3, splits)
    # prefill chunks: 64 (token, head) rows per program (swept: 128 rows were 20% slower at 2k tokens)
    return AttentionConfig(max(1, 64 // group), 64, 4, 3, 1)


def paged_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    scale,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
):
    """kernels/attention.py's paged_attention; sinks: fp32 [Hq] or None."""
    num_tokens, n_heads, head_dim = q.shape
    num_seqs = context_lens.numel()
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    out = torch.empty(num_tokens, n_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    max_context = block_tables.shape[1] * page  # an upper bound known without a device sync
    if window is not None:  # keys per query
        max_context = min(max_context, window)
    cfg = config or pick_config(num_tokens, num_seqs, n_kv, group, head_dim, max_context, triton_util.num_sms(q.device))
    n_blocks = num_tokens if cfg.block_q == 1 else num_tokens // cfg.block_q + num_seqs
    splits = cfg.splits
    if splits > 1:
        part_o = torch.empty(splits, num_tokens, n_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, num_tokens, n_heads, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out

    _paged_attention_kernel[(n_blocks, n_kv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out if sinks is None else sinks,
        out,
        part_o,
        part_lse,
        triton_util.split_counters(q.device, n_blocks * n_kv, "paged_attention"),
        scale * LOG2E.value,
        window or 0,
        num_seqs,
        num_tokens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=page,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=max(16, triton.next_power_of_2(cfg.block_q * group)),
        BLOCK_N=cfg.block_n,
        SPLIT=splits > 1,
        SLIDING=window is not None,
        SINKS=sinks is not None,
        DT=triton_util.arith_dtype(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **triton_util.pdl_launch(q.device),
    )
    return out
