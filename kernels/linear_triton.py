"""y = x @ W^T for a QuantWeight on CUDA. Three paths by the number of rows M (pick_config):

- M = 1: a GEMV kernel, fp32 FMAs on CUDA cores, one token per program. There is no shared memory, no barrier
  and no operand re-layout, so its loop is bound by instruction issue alone.
- M up to DENSE_M: a fused dequantize + tl.dot kernel. It uses mma.sync with the weights as the right operand;
  from 64 rows it uses wgmma with the weights as the left (register) operand.
- Above DENSE_M: dequantize to a dense copy, then cuBLAS.

At small M the cost is reading the weights once: 0.53 B per 4-bit weight with group-128 fp16 scales. Both kernels
therefore split K across programs when N alone gives too few of them. Splits are reduced without atomics on the
data: each split stores an fp32 partial, and the last split of a tile to finish (a counter per tile) sums them in
split order and writes y, so results do not depend on timing. The weights are read in the tiled GPU layout of
kernels/qweight_triton.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.qweight import QuantWeight
from kernels.qweight_triton import dequantize_rows_triton, load_dequant, magic, tiled_offset, tiled_words
from kernels.triton_util import arith_dtype, num_sms

# Above this many rows: dequantize to a dense copy, then cuBLAS. Not yet measured: an estimate from M = 128, where
# the fused kernel took 359 us a block and a dequantize pass (548 MB) + cuBLAS would take about 270 us.
DENSE_M = 256


@dataclass(frozen=True)
class Config:
    block_m: int  # tokens per tile: 1 for the GEMV kernel (one token per program), else >= 16 (tl.dot)
    block_n: int  # output features per tile
    block_k: int  # K per loop step
    split_k: int  # programs sharing one tile's K range
    num_warps: int
    num_stages: int


@triton.jit
def _qmatmul_kernel(x_ptr, w_ptr, s_ptr, o_ptr, perm_ptr, y_ptr, part_ptr, count_ptr, magic,
                    M, N, K, stride_xm, stride_ym, k_per_split, split_k,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, DT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = load_dequant(w_ptr, s_ptr, o_ptr, magic, rows, row_mask, k0, k_hi, K,
                         BITS, GROUP, HAS_OFFSET, BLOCK_K, EVEN_N and EVEN_K, DT)
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_hi
        kx = k
        if HAS_PERM:  # GPTQ act-order: y = x[:, perm] @ W^T, gathered from the (small, cached) activations
            kx = tl.load(perm_ptr + k, mask=k_mask, other=0)
        if EVEN_K:
            x = tl.load(x_ptr + m[:, None] * stride_xm + kx[None, :], mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + m[:, None] * stride_xm + kx[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
        if SWAP_AB:  # wgmma (BLOCK_M >= 64) takes the dequantized weights from registers as its left operand
            acc = tl.dot(w, tl.trans(x.to(DT)), acc)
        else:  # mma.sync (BLOCK_M < 64) takes them from registers as the right operand, in a few vector moves
            acc = tl.dot(x.to(DT), tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)

    _store(acc, y_ptr, part_ptr, count_ptr, m, m_mask, rows, row_mask, M, N, stride_ym,
           pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, perm_ptr, y_ptr, part_ptr, count_ptr, magic,
                  M, N, K, stride_xm, stride_ym, k_per_split, split_k,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr):
    """One token per program (grid axis 1), fp32 FMAs on CUDA cores: no shared memory, no barriers, no operand
    layout changes, so the loop stays issue-bound. A field of a word is read in place: (word & mask) | 2**23
    as fp32 is 2**23 + q * 2**(BITS*j); one FADD centres it exactly and the activation it multiplies is
    pre-scaled by 2**-(BITS*j). Per weight: LOP3, FADD, FFMA. Scales apply once per word."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    VPW: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = VPW // 2  # fields per 16-bit half word
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    CENTER: tl.constexpr = 0 if HAS_OFFSET else 1 << (BITS - 1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    g = tl.arange(0, BLOCK_K // SPAN)[None, :, None]
    w = tl.arange(0, SPAN // VPW)[None, None, :]
    r = rows.to(tl.int64)[:, None, None]
    x_row = x_ptr + pid_m * stride_xm

    acc = tl.zeros([BLOCK_N, BLOCK_K // SPAN, SPAN // VPW], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_word = k0 + (g * (SPAN // VPW) + w) * VPW  # K of each word's first value
        word_ptrs = w_ptr + tiled_offset(r, k_word // VPW, K // VPW)
        group = r * (K // GROUP) + (k0 + g * SPAN) // GROUP
        if EVEN:
            words = tl.load(word_ptrs, eviction_policy="evict_first")
            scale = tl.load(s_ptr + group).to(tl.float32)
        else:  # groups past k_hi are masked too: past K they would be the next row's, or past the end
            mask = row_mask[:, None, None] & (k_word < k_hi)
            group_mask = row_mask[:, None, None] & (k0 + g * SPAN < k_hi)
            words = tl.load(word_ptrs, mask=mask, other=0, eviction_policy="evict_first")
            scale = tl.load(s_ptr + group, mask=group_mask, other=0.0).to(tl.float32)
        hi = words >> 16
        t = tl.zeros([BLOCK_N, BLOCK_K // SPAN, SPAN // VPW], dtype=tl.float32)
        x_sum = tl.zeros([1, BLOCK_K // SPAN, SPAN // VPW], dtype=tl.float32)
        for j in tl.static_range(VPW):
            k = k_word + j
            if HAS_PERM:
                k = tl.load(perm_ptr + k, mask=k < k_hi, other=0)
            xj = tl.load(x_row + k, mask=k_word < k_hi, other=0.0).to(tl.float32)
            x_sum += xj
            field = ((words if j < HALF else hi) & (((1 << BITS) - 1) << (BITS * (j % HALF)))) | magic
            q = field.to(tl.float32, bitcast=True) - (8388608.0 + CENTER * (1 << (BITS * (j % HALF))))
            t += q * (xj * (1.0 / (1 << (BITS * (j % HALF)))))
        acc += t * scale
        if HAS_OFFSET:
            if EVEN:
                offset = tl.load(o_ptr + group).to(tl.float32)
            else:
                offset = tl.load(o_ptr + group, mask=group_mask, other=0.0).to(tl.float32)
            acc += offset * x_sum

    y = tl.sum(tl.sum(acc, 2), 1)[None, :]
    m = pid_m + tl.arange(0, 1)
    _store(y, y_ptr, part_ptr, count_ptr, m, m < M, rows, row_mask, M, N, stride_ym,
           pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


@triton.jit
def _store(acc, y_ptr, part_ptr, count_ptr, m, m_mask, rows, row_mask, M, N, stride_ym, tile, pid_k, split_k,
           SPLIT: tl.constexpr):
    """Writes acc [len(m), len(rows)] to y; with a split K, through the fp32 partials (see the docstring)."""
    y_ptrs = y_ptr + m[:, None] * stride_ym + rows[None, :]
    out_mask = m_mask[:, None] & row_mask[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_ptr + m[:, None] * N + rows[None, :]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter's release
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == split_k - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(split_k):
                total += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile split counters, zero between launches (the last split resets its own). One stream only."""
    c = _counters.get(device)
    if c is None or c.numel() < tiles:
        c = _counters[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return c


def pick_config(m: int, n: int, k: int, num_sms: int) -> Config:
    """Tiles by M bucket, from sweeps on an H200 (BENCHMARKS.md): the GEMV kernel for one token, small tensor-core
    tiles (several CTAs per SM: the dequantize loop is latency-bound) up to 32, K split until the grid has 4-8
    programs per SM."""
    if m == 1:
        block_m, block_n, block_k, warps, stages, per_sm = 1, 64, 128, 4, 3, 8
    elif m <= 32:
        block_m, block_n, block_k, warps, stages, per_sm = max(16, triton.next_power_of_2(m)), 64, 256, 4, 2, 4
    else:
        block_m, block_n, block_k, warps, stages, per_sm = 64, 128, 128, 8, 3, 4
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = max(1, min(round(per_sm * num_sms / tiles), triton.cdiv(k, block_k) // 2))
    return Config(block_m, block_n, block_k, split, warps, stages)


def qmatmul_triton(x: torch.Tensor, w: QuantWeight, config: Config | None = None) -> torch.Tensor:
    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > DENSE_M and config is None:
        if w.perm is not None:
            x2 = x2[:, w.perm]
        return F.linear(x2, dequantize_rows_triton(w, None, x.dtype)).view(*x.shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    cfg = config or pick_config(m, n, k, num_sms(x.device))
    steps_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    k_per_split = steps_per_split * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    args = (x2, tiled_words(w), w.scales, w.scales if w.offsets is None else w.offsets, y if w.perm is None else w.perm,
            y, part, _tile_counters(x.device, grid[0] * grid[1]))
    sizes = (m, n, k, x2.stride(0), y.stride(0), k_per_split, split)
    fmt = dict(BITS=w.bits, GROUP=w.group_size, HAS_OFFSET=w.offsets is not None, HAS_PERM=w.perm is not None)
    even_n, even_k = n % cfg.block_n == 0, k % k_per_split == 0
    if cfg.block_m == 1:
        _qgemv_kernel[grid](*args, 0x4B000000, *sizes, **fmt, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                            SPLIT=split > 1, EVEN=even_n and even_k,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        dt = arith_dtype(x.dtype)
        _qmatmul_kernel[grid](*args, magic(w.bits, dt), *sizes, **fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              BLOCK_K=cfg.block_k, SPLIT=split > 1, EVEN_N=even_n, EVEN_K=even_k,
                              SWAP_AB=cfg.block_m >= 64, DT=dt, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(*x.shape[:-1], n)
