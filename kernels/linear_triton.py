"""y = x @ W^T for a QuantWeight on CUDA.

Up to DENSE_M rows, one fused kernel: each program owns BLOCK_N output features and BLOCK_M tokens and walks its
share of K in steps (kernels/qweight_triton.py: one step = GROUP bytes of each row = two 4-bit groups). The
weights are tl.dot's left operand, y^T = W x^T, so the dequantized values are made in registers in the MMA operand
layout (wgmma from BLOCK_N = 64 on Hopper; mma.sync for BLOCK_M = 8) while the activations wait in shared memory.
Each group's dot is on the centred integers (or MXFP4's E2M1 values), exact in fp16/bf16, and its scale multiplies
the fp32 partial; offsets add offset * sum(x over the group). Scales come as one 32-bit word per row and step (two
groups), wide enough for cp.async, so the pipelined loop prefetches them with the bytes. That loop, `qdot`, is
shared with the experts' grouped matmul (kernels/moe_triton.py).
With an activation (the gated MLP's gate_up projection), a tile's rows alternate gate and up rows of the same
features, and the epilogue writes act(gate) * up: one launch fewer per layer.
Above DENSE_M rows: dequantize to a dense copy, then cuBLAS; with a dense copy kept (QuantWeight.kept_dense), cuBLAS
from DENSE_M_KEPT rows, where its fp16 matmul costs less than this kernel's third 64-row tile, and for a small
weight (under SMALL_WEIGHT values: a small model's) from DENSE_M_KEPT_SMALL rows: there the 4x fewer bytes save
at most 1.5 µs, and cuBLAS's tiles cost less than ours from 16 rows.

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

from llamaterm.kernels import triton_util
from llamaterm.kernels.activation_triton import act_and_mul_triton, gated
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import (
    ROW_PAD,
    centred_values,
    dequantize_rows_triton,
    gpu_layout,
    step_params,
    use_asm,
)
from llamaterm.kernels.triton_util import last_to_arrive, launch_next, wait_previous

# Above this many rows: dequantize to a dense copy, then cuBLAS (BENCHMARKS.md: the fused kernel at M = 128).
DENSE_M = 256
# Above this many rows, a kept dense copy: fp16 cuBLAS 155-164 µs per 8B block against ours 107.6 at M = 64 and
# 177.7 at M = 128 (a mixed step's token bucket, engine/serving/cuda_graph.py).
DENSE_M_KEPT = 96
# A weight of fewer values than this reads in about 2 µs dense at the copy rate, and from DENSE_M_KEPT_SMALL rows its
# kept dense copy goes to cuBLAS: a SmolLM2-135M layer's four matmuls take 25.1-25.5 µs there against ours 32.0 at
# 16 rows and 40.5 at 64 (alone, L2 flushed); below, ours with dependent launch win the decode step by 1-5%
# (BENCHMARKS.md).
SMALL_WEIGHT = 4 << 20
DENSE_M_KEPT_SMALL = 8


@dataclass(frozen=True)
class Config:
    block_m: int  # tokens per tile: 8 (mma.sync), or 16 and up (wgmma with BLOCK_N >= 64 and 4 warps)
    block_n: int  # output features per tile
    split_k: int  # programs sharing one tile's steps
    num_warps: int
    num_stages: int


@triton.jit
def qdot(
    acc,
    x_ptr,
    x_rows,
    m_mask,
    w_ptr,
    s_ptr,
    o_ptr,
    rows,
    row_mask,
    n_pad,
    K,
    s_lo,
    s_hi,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    CODEBOOK: tl.constexpr,
    MASK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """acc [BLOCK_N, BLOCK_M] plus W[rows] x^T over the steps s_lo .. s_hi - 1 of a weight in the GPU layout (bytes
    at w_ptr, scales and offsets at s_ptr and o_ptr, n_pad rows a step). The tokens are the rows of x at offsets
    x_rows [BLOCK_M] (masked by m_mask: a masked token reads zeros); MASK_N: weight rows under row_mask only (else
    every row is below n_pad)."""
    GPS: tl.constexpr = 8 // BITS  # groups per step
    PACK: tl.constexpr = 4 if acc.shape[1] <= 8 else 2  # bytes a thread holds (centred_values)
    j = tl.arange(0, GROUP)
    byte_ptrs = w_ptr + tl.cast(s_lo, tl.int64) * n_pad * GROUP + rows[:, None] * GROUP + j[None, :]
    # num_stages on the loop (not only on the launch) makes Triton pipeline every load in it, the scales too
    for s in tl.range(s_lo, s_hi, num_stages=STAGES):
        if MASK_N:
            b = tl.load(byte_ptrs, mask=row_mask[:, None], other=0, eviction_policy="evict_first")
        else:
            b = tl.load(byte_ptrs, eviction_policy="evict_first")  # read once: leave L2 to the activations
        byte_ptrs += n_pad * GROUP
        values = centred_values(b, BITS, HAS_OFFSET, CODEBOOK, DT, ASM, PACK)
        scales = step_params(s_ptr, s, n_pad, rows, row_mask, GPS)
        if HAS_OFFSET:
            offsets = step_params(o_ptr, s, n_pad, rows, row_mask, GPS)
        for h in tl.static_range(GPS):
            k = (s * GPS + h) * GROUP + j
            if EVEN_K:
                x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            p = tl.dot(values[h], tl.trans(x.to(DT)))
            acc += p * scales[h][:, None]
            if HAS_OFFSET:
                acc += offsets[h][:, None] * tl.sum(x.to(tl.float32), 1)[None, :]
    return acc


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
    CODEBOOK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    STAGES: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n_steps = tl.cdiv(K, GROUP * (8 // BITS))
    n_pad = tl.cdiv(N, ROW_PAD) * ROW_PAD
    if GATED:  # the tile's rows alternate gate and up rows of the same BLOCK_N // 2 features
        features = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rows = features + (tl.arange(0, BLOCK_N) % 2) * (N // 2)
        row_mask = features < N // 2
    else:
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows >= N read zero padding (n_pad) or are masked out of y
        row_mask = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    pad_mask = row_mask if GATED else rows < n_pad
    s_lo = pid_k * steps_per_split
    s_hi = tl.minimum(s_lo + steps_per_split, n_steps)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc = qdot(
        acc,
        x_ptr,
        m * stride_xm,
        m_mask,
        w_ptr,
        s_ptr,
        o_ptr,
        rows,
        pad_mask,
        n_pad,
        K,
        s_lo,
        s_hi,
        BITS,
        GROUP,
        HAS_OFFSET,
        CODEBOOK,
        not EVEN_N,
        EVEN_K,
        DT,
        ASM,
        STAGES,
    )

    launch_next(PDL)  # only now: see triton_util.launch_next
    part_ptrs = part_ptr + m[:, None] * N + rows[None, :]
    mask = m_mask[:, None] & row_mask[None, :]
    if not SPLIT:
        _write(tl.trans(acc), y_ptr, stride_ym, m, m_mask, rows, row_mask, pid_n, N, BLOCK_N, GATED, ACTIVATION)
    else:  # through the fp32 partials (see the docstring), split s's at part_ptrs + s * M * N
        tl.store(part_ptrs + pid_k * M * N, tl.trans(acc), mask=mask)
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if last_to_arrive(counter, split_k):
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(split_k):
                total += tl.load(part_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _write(total, y_ptr, stride_ym, m, m_mask, rows, row_mask, pid_n, N, BLOCK_N, GATED, ACTIVATION)
            tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _write(
    acc,
    y_ptr,
    stride_ym,
    m,
    m_mask,
    rows,
    row_mask,
    pid_n,
    N,
    BLOCK_N: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """Stores the tile acc [BLOCK_M, BLOCK_N] to y; GATED: act(gate) * up of its column pairs, each rounded to y's
    dtype first as the unfused activation reads them."""
    dt = y_ptr.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(acc.to(dt).to(tl.float32), [acc.shape[0], BLOCK_N // 2, 2]))
        features = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = m_mask[:, None] & (features < N // 2)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + features[None, :], gated(gate, up, ACTIVATION).to(dt), mask=mask)
    else:
        tl.store(y_ptr + m[:, None] * stride_ym + rows[None, :], acc.to(dt), mask=m_mask[:, None] & row_mask[None, :])


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


def qmatmul_triton(
    x: torch.Tensor, w: QuantWeight, config: Config | None = None, activation: str | None = None
) -> torch.Tensor:
    """x @ w^T; with an activation (kernels/activation.py's ACTIVATIONS), act(gate) * up of its halves [..., N / 2]
    (w stacks the gate and up projections), in the same kernel."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if w.perm is not None:  # GPTQ act-order: y = x[:, perm] @ W^T; gather the (small) activations once
        x2 = x2[:, w.perm]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    kept = w.kept_dense(x.dtype)
    kept_from = DENSE_M_KEPT_SMALL if n * k < SMALL_WEIGHT else DENSE_M_KEPT
    if config is None and (m > DENSE_M or (kept is not None and m > kept_from)):
        dense = kept if kept is not None else dequantize_rows_triton(w, None, x.dtype)
        y = F.linear(x2, dense).view(*x.shape[:-1], n)
        return y if activation is None else act_and_mul_triton(y, activation)
    n_out = n if activation is None else n // 2
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n_out)
    layout = gpu_layout(w)
    steps = layout.values.shape[0]
    cfg = config or pick_config(m, n, k, w.group_size, steps, triton_util.num_sms(x.device))
    steps_per_split = triton.cdiv(steps, cfg.split_k)
    split = triton.cdiv(steps, steps_per_split)
    tile_n = cfg.block_n if activation is None else cfg.block_n // 2  # output features per tile
    grid = (triton.cdiv(n_out, tile_n), triton.cdiv(m, cfg.block_m), split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    _qmatmul_kernel[grid](
        x2,
        layout.values,
        layout.scales,
        layout.scales if layout.offsets is None else layout.offsets,
        y,
        part,
        triton_util.split_counters(x.device, grid[0] * grid[1], "qmatmul"),
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
        CODEBOOK=w.codebook,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT=split > 1,
        EVEN_N=n_out % tile_n == 0,
        EVEN_K=k % (w.group_size * 8 // w.bits) == 0,
        DT=triton_util.arith_dtype(x.dtype),
        ASM=use_asm(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        STAGES=cfg.num_stages,
        GATED=activation is not None,
        ACTIVATION=activation,
        **triton_util.pdl_launch(x.device),
    )
    return y.view(*x.shape[:-1], n_out)
