"""y = x @ W^T for a QuantWeight on CUDA.

Up to DENSE_M rows, one fused kernel: each program owns BLOCK_N output features and BLOCK_M tokens and walks its
share of K in steps (kernels/qweight_triton.py: one step = GROUP bytes of each row = two 4-bit groups). The
weights are tl.dot's left operand, y^T = W x^T, so the dequantized values are made in registers in the MMA operand
layout (wgmma from BLOCK_N = 64 on Hopper; mma.sync for BLOCK_M = 8) while the activations wait in shared memory.
Each group's dot is on the centred integers, exact in fp16/bf16, and its scale multiplies the fp32 partial; offsets
add offset * sum(x over the group). Scales come as one 32-bit word per row and step (two groups), wide enough for
cp.async, so the pipelined loop prefetches them with the bytes.
Above DENSE_M rows: dequantize to a dense copy, then cuBLAS; with a dense copy kept (QuantWeight.kept_dense), cuBLAS
from DENSE_M_KEPT rows, where its fp16 matmul costs less than this kernel's third 64-row tile.

At small M the cost is reading the weights once: 0.53 B per 4-bit weight with group-128 fp16 scales. K is split
across programs when N alone gives too few of them. Splits are reduced without atomics on the data: each split
stores an fp32 partial, and the last split of a tile to finish (a counter per tile) sums them in split order and
writes y, so results do not depend on timing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import (
    ROW_PAD,
    centred_values,
    dequantize_rows_triton,
    gpu_layout,
    step_params,
    use_asm,
)
from llamaterm.kernels.triton_util import after_previous, arith_dtype, num_sms, pdl_launch

# Above this many rows: dequantize to a dense copy, then cuBLAS (BENCHMARKS.md: the fused kernel at M = 128).
DENSE_M = 256
# Above this many rows, a kept dense copy: fp16 cuBLAS 155-164 µs per 8B block against ours 107.6 at M = 64 and
# 177.7 at M = 128 (a mixed step's token bucket, engine/serving/cuda_graph.py).
DENSE_M_KEPT = 96


@dataclass(frozen=True)
class Config:
    block_m: int  # tokens per tile: 8 (mma.sync), or 16 and up (wgmma with BLOCK_N >= 64 and 4 warps)
    block_n: int  # output features per tile
    split_k: int  # programs sharing one tile's steps
    num_warps: int
    num_stages: int


@triton.jit
def _qmatmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    steps_per_split,
    split_k,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    GPS: tl.constexpr = 8 // BITS  # groups per step
    n_steps = tl.cdiv(K, GROUP * GPS)
    n_pad = tl.cdiv(N, ROW_PAD) * ROW_PAD
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows >= N read zero padding (n_pad) or are masked out of y
    row_mask = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    j = tl.arange(0, GROUP)
    pad_mask = rows < n_pad
    s_lo = pid_k * steps_per_split
    s_hi = tl.minimum(s_lo + steps_per_split, n_steps)
    byte_ptrs = w_ptr + s_lo.to(tl.int64) * n_pad * GROUP + rows[:, None] * GROUP + j[None, :]

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # num_stages on the loop (not only on the launch) makes Triton pipeline every load in it, the scales too
    for s in tl.range(s_lo, s_hi, num_stages=STAGES):
        if EVEN_N:
            b = tl.load(byte_ptrs, eviction_policy="evict_first")  # read once: leave L2 to the activations
        else:
            b = tl.load(byte_ptrs, mask=pad_mask[:, None], other=0, eviction_policy="evict_first")
        byte_ptrs += n_pad * GROUP
        values = centred_values(b, BITS, HAS_OFFSET, DT, ASM, 4 if BLOCK_M <= 8 else 2)
        scales = step_params(s_ptr, s, n_pad, rows, pad_mask, GPS)
        if HAS_OFFSET:
            offsets = step_params(o_ptr, s, n_pad, rows, pad_mask, GPS)
        for h in tl.static_range(GPS):
            g = s * GPS + h
            k = g * GROUP + j
            if EVEN_K:
                x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(
                    x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0
                )
            p = tl.dot(values[h], tl.trans(x.to(DT)))
            acc += p * scales[h][:, None]
            if HAS_OFFSET:
                acc += offsets[h][:, None] * tl.sum(x.to(tl.float32), 1)[None, :]

    y_ptrs = y_ptr + m[:, None] * stride_ym + rows[None, :]
    part_ptrs = part_ptr + m[:, None] * N + rows[None, :]
    out_mask = m_mask[:, None] & row_mask[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    _store(tl.trans(acc), y_ptrs, part_ptrs, M * N, out_mask, count_ptr + tile, pid_k, split_k, SPLIT)


@triton.jit
def _store(acc, y_ptrs, part_ptrs, part_size, mask, counter, pid_k, split_k, SPLIT: tl.constexpr):
    """Writes acc to y; with a split K, through the fp32 partials (see the docstring), split s's at
    part_ptrs + s * part_size."""
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptrs + pid_k * part_size, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter's release
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(split_k):
                total += tl.load(part_ptrs + s * part_size, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)  # ready for the next launch


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile split counters, zero between launches (the last split resets its own). One stream only."""
    c = _counters.get(device)
    if c is None or c.numel() < tiles:
        c = _counters[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return c


def pick_config(m: int, n: int, k: int, group: int, steps: int, num_sms: int) -> Config:
    """Tiles by M bucket, from sweeps on an H200 (BENCHMARKS.md). K is split until the grid has `per_sm`
    programs per SM. Groups under 128 make short steps (few bytes per row): they want 128-row tiles and more
    programs. At a short K (SmolLM2's 576: 9 steps) narrow tiles and no split are 0.4-0.7 µs faster per call."""
    short = group < 128
    if m <= 8 and steps < 16:  # a short K (small models): the split's reduction costs more than it hides
        return Config(8, 32, 1, 2, 3)
    if m <= 16:  # 8 tokens: mma.sync; 16: wgmma
        block_m, block_n, warps, per_sm = (8 if m <= 8 else 16), (128 if short else 64), 4, 4
        if short and n >= 16384 and m <= 8:  # a wide lm_head
            block_n = 256
    else:
        block_m = min(64, triton.next_power_of_2(m))
        if block_m == 64 and not short:
            block_n, warps, per_sm = 128, 8, 1
        else:
            block_n, warps = (128, 4) if n >= 16384 else (64, 4)
            per_sm = 4 if short else 2
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(round(per_sm * num_sms / tiles), steps // 2))
    return Config(block_m, block_n, split, warps, 3)


def qmatmul_triton(x: torch.Tensor, w: QuantWeight, config: Config | None = None) -> torch.Tensor:
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if w.perm is not None:  # GPTQ act-order: y = x[:, perm] @ W^T; gather the (small) activations once
        x2 = x2[:, w.perm]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    kept = w.kept_dense(x.dtype)
    if config is None and (m > DENSE_M or (kept is not None and m > DENSE_M_KEPT)):
        dense = kept if kept is not None else dequantize_rows_triton(w, None, x.dtype)
        return F.linear(x2, dense).view(*x.shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    layout = gpu_layout(w)
    steps = layout.values.shape[0]
    cfg = config or pick_config(m, n, k, w.group_size, steps, num_sms(x.device))
    steps_per_split = triton.cdiv(steps, cfg.split_k)
    split = triton.cdiv(steps, steps_per_split)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _qmatmul_kernel[grid](
        x2,
        layout.values,
        layout.scales,
        layout.scales if layout.offsets is None else layout.offsets,
        y,
        part,
        _tile_counters(x.device, grid[0] * grid[1]),
        m,
        n,
        k,
        x2.stride(0),
        y.stride(0),
        steps_per_split,
        split,
        BITS=w.bits,
        GROUP=w.group_size,
        HAS_OFFSET=w.offsets is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT=split > 1,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % (w.group_size * 8 // w.bits) == 0,
        DT=arith_dtype(x.dtype),
        ASM=use_asm(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        STAGES=cfg.num_stages,
        **pdl_launch(x.device),
    )
    return y.view(*x.shape[:-1], n)
