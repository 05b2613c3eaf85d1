"""y = x @ W^T for a QuantWeight on CUDA: one fused dequantize-and-multiply kernel up to DENSE_M rows, and
dequantize-then-cuBLAS above.

At small M the cost is reading the weights once (0.53 B per 4-bit weight with group-128 fp16 scales), so the kernel
must keep every SM streaming: it computes y^T = W x^T with the weight tile as the wide left operand of the tensor
core product (the token dimension, padded to 16, is the narrow one) and splits K across programs when N alone
gives too few of them. Splits are reduced without atomics on the data: each split stores an fp32 partial, and the
last split of a tile to finish (a counter per tile) sums them in split order and writes y, so results do not
depend on timing. Above DENSE_M the product is compute-bound and cuBLAS on a dequantized copy wins.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.qweight import QuantWeight
from kernels.qweight_triton import dequantize_rows_triton, load_dequant, magic, words
from kernels.triton_util import arith_dtype, num_sms

DENSE_M = 256  # above this many rows: dequantize to a dense copy and use cuBLAS (see BENCHMARKS.md)


@dataclass(frozen=True)
class Config:
    block_m: int  # tokens per tile (>= 16: the narrow operand of tl.dot)
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
                    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

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
        # x is the left operand: with M <= 16 Triton uses mma.sync, which takes the dequantized weights from
        # registers in a few vector moves (wgmma would want them in shared memory or serialize on them)
        acc = tl.dot(x.to(DT), tl.trans(w), acc)

    y_ptrs = y_ptr + m[:, None] * stride_ym + rows[None, :]
    out_mask = m_mask[:, None] & row_mask[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = part_ptr + m[:, None] * N + rows[None, :]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter's release
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == split_k - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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
    """Tile shape by M bucket; split K until the grid has about four programs per SM."""
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k, warps, stages = (64, 256, 4, 3) if m <= 64 else (128, 64, 8, 3)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    steps = triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(4 * num_sms, tiles), steps // 4))
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
    counters = _tile_counters(x.device, grid[0] * grid[1])
    dt = arith_dtype(x.dtype)
    _qmatmul_kernel[grid](
        x2, words(w), w.scales, w.scales if w.offsets is None else w.offsets, y if w.perm is None else w.perm,
        y, part, counters, magic(w.bits, dt), m, n, k, x2.stride(0), y.stride(0), k_per_split, split,
        BITS=w.bits, GROUP=w.group_size, HAS_OFFSET=w.offsets is not None, HAS_PERM=w.perm is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=k % k_per_split == 0, DT=dt,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.view(*x.shape[:-1], n)
