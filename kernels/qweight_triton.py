"""Triton dequantization of QuantWeight: the unpack step shared by the quantized kernels, and a kernel that
dequantizes rows (embedding lookup; the whole matrix before a prefill-size cuBLAS matmul).

GPU layout (`tiled_words`, made on first use and kept on the QuantWeight): QuantWeight's bytes (4-bit: two values
per byte, low nibble first) read as little-endian int32 words hold 32 // bits consecutive K values each, value j at
bits [bits*j, bits*(j+1)), and every group (16 values or more) covers whole words. The words are then interleaved
by blocks of ROWS rows: word (n, kw) sits at ((n // ROWS) * K_words + kw) * ROWS + n % ROWS, so a block of rows
streams its whole K range from one contiguous run of memory. In the plain row-major order a program reading a
[rows, 128] tile touches 64-byte pieces 2 KB apart, and HBM delivered about a quarter of its bandwidth that way.

Unpacking must keep up with memory (about 32 weights per clock per SM on an H200), and int->float conversion
instructions run at a quarter of the FMA rate, so values are made with bit tricks, two per 32-bit op: OR-ing
the fields of `(word >> 4i) & 0x000F000F` into 0x6400 (fp16 1024.0) gives the fp16 pair (1024 + q_i, 1024 + q_i+4)
exactly; for bf16 activations 0x4300 (bf16 128.0) does the same for 4-bit values. One packed subtract centres the
pair and one packed multiply (or FMA, with offsets) scales it: about 2 instructions per weight.
"""

import torch
import triton
import triton.language as tl

from kernels.qweight import QuantWeight
from kernels.triton_util import arith_dtype


@triton.jit
def _pair(p, scale, offset, BITS: tl.constexpr, MAGIC_BF16: tl.constexpr, DT: tl.constexpr,
          HAS_OFFSET: tl.constexpr):
    """int32 of two 16-bit magic patterns -> [..., 2] dequantized values in DT."""
    CENTER: tl.constexpr = 0 if HAS_OFFSET else 1 << (BITS - 1)
    if MAGIC_BF16:  # 128 + q, exact in bf16 for q < 128; centred in DT (bf16 on the GPU)
        lo = p.to(tl.int16).to(tl.bfloat16, bitcast=True).to(DT) - (128.0 + CENTER)
        hi = (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True).to(DT) - (128.0 + CENTER)
    else:  # 1024 + q in fp16, centred there (exact), then to DT (exact: |q - center| < 256)
        lo = (p.to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)).to(DT)
        hi = ((p >> 16).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)).to(DT)
    if HAS_OFFSET:
        return tl.join(lo * scale + offset, hi * scale + offset)
    else:
        return tl.join(lo * scale, hi * scale)


@triton.jit
def _dequant_words(words, scale, offset, magic, BITS: tl.constexpr, DT: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """words int32 [...]; scale, offset (DT) broadcastable to it -> DT [..., 2, 2(, 2)]: each word's values in K
    order along the new minor dims. tl.join adds a minor dimension held by the same thread: no data moves."""
    MAGIC_BF16: tl.constexpr = BITS == 4 and DT != tl.float16
    if BITS == 4:  # pair i holds values (i, i + 4); the joins order them 4h + 2*j1 + j0
        MASK: tl.constexpr = 0x000F000F
        p0 = _pair((words & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        p1 = _pair(((words >> 4) & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        p2 = _pair(((words >> 8) & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        p3 = _pair(((words >> 12) & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        return tl.join(tl.join(p0, p2), tl.join(p1, p3))
    else:  # 8 bits: pair i holds values (i, i + 2); order 2h + i
        MASK: tl.constexpr = 0x00FF00FF
        p0 = _pair((words & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        p1 = _pair(((words >> 8) & MASK) | magic, scale, offset, BITS, MAGIC_BF16, DT, HAS_OFFSET)
        return tl.join(p0, p1)


ROWS = tl.constexpr(16)  # rows interleaved per word column in the GPU layout


@triton.jit
def tiled_offset(row, word, K_WORDS):
    """Offset of word `word` of row `row` in the tiled GPU layout (see the module docstring)."""
    return (row // ROWS * K_WORDS + word) * ROWS + row % ROWS


@triton.jit
def load_dequant(w_ptr, s_ptr, o_ptr, magic, rows, row_mask, k0, k_end, K,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DT: tl.constexpr):
    """Weights rows x [k0, k0 + BLOCK_K), dequantized -> DT [len(rows), BLOCK_K].

    The tile is read as [rows, groups, words per group] so that scales load once per group and broadcast, and the
    word loads vectorize. EVEN: every row < N and k0 + BLOCK_K <= k_end, so nothing is masked (masks at
    element granularity would stop 16-byte loads). Otherwise masked rows and K >= k_end read as zero weights.
    """
    VPW: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # K covered by one scale within the tile
    g = tl.arange(0, BLOCK_K // SPAN)[None, :, None]
    w = tl.arange(0, SPAN // VPW)[None, None, :]
    r = rows.to(tl.int64)[:, None, None]
    word_ptrs = w_ptr + tiled_offset(r, k0 // VPW + g * (SPAN // VPW) + w, K // VPW)
    group = r * (K // GROUP) + (k0 + g * SPAN) // GROUP
    if EVEN:
        words = tl.load(word_ptrs, eviction_policy="evict_first")  # read once: leave L2 to the activations
        scale = tl.load(s_ptr + group).to(DT)
        offset = scale  # unused without offsets
        if HAS_OFFSET:
            offset = tl.load(o_ptr + group).to(DT)
    else:
        k_mask = (k0 + g * SPAN + w * VPW) < k_end
        rmask = row_mask[:, None, None]
        words = tl.load(word_ptrs, mask=rmask & k_mask, other=0, eviction_policy="evict_first")
        group_mask = rmask & (k0 + g * SPAN < k_end)
        scale = tl.load(s_ptr + group, mask=group_mask, other=0.0).to(DT)
        offset = scale
        if HAS_OFFSET:
            offset = tl.load(o_ptr + group, mask=group_mask, other=0.0).to(DT)
    values = _dequant_words(words, scale, offset, magic, BITS, DT, HAS_OFFSET)
    return tl.reshape(values, [rows.shape[0], BLOCK_K])


@triton.jit
def _dequant_rows_kernel(w_ptr, s_ptr, o_ptr, ids_ptr, out_ptr, magic, n_rows, K,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_IDS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = r < n_rows
    rows = r
    if HAS_IDS:
        rows = tl.load(ids_ptr + r, mask=row_mask, other=0)
    w = load_dequant(w_ptr, s_ptr, o_ptr, magic, rows, row_mask, k0, K, K, BITS, GROUP, HAS_OFFSET, BLOCK_K, False, DT)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (k < K)[None, :])


def magic(bits: int, dt: tl.dtype) -> int:
    """The exponent pattern OR-ed into each 16-bit field (see _dequant_words). The kernels take it as an argument,
    not a constant, so that ptxas keeps it in one register instead of re-materializing it for every LOP3."""
    return 0x43004300 if bits == 4 and dt != tl.float16 else 0x64006400


def _tile(w: QuantWeight) -> torch.Tensor:
    n, k_words = w.shape[0], w.shape[1] * w.bits // 32
    plain = w.packed.view(torch.int32)
    n_pad = -(-n // ROWS) * ROWS
    if n_pad != n:
        plain = torch.cat([plain, plain.new_zeros(n_pad - n, k_words)])
    return plain.view(n_pad // ROWS, ROWS, k_words).transpose(1, 2).contiguous().view(-1)


def tiled_words(w: QuantWeight) -> torch.Tensor:
    """The values in the GPU layout (see the module docstring), made on first use and kept on w."""
    return w.prepared("tiled_words", _tile)


def dequantize_rows_triton(w: QuantWeight, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w dequantized to dtype [len(ids), K]; ids None means all rows (w.dequantize(dtype))."""
    n, k = w.shape
    n_rows = n if ids is None else ids.numel()
    out = torch.empty(n_rows, k, dtype=dtype, device=w.packed.device)
    if n_rows == 0:
        return out
    block_k = min(1024, triton.next_power_of_2(k))
    block_r = max(1, 4096 // block_k)  # ~4k values per program: 32 per thread
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(k, block_k))
    offsets = w.scales if w.offsets is None else w.offsets
    dt = arith_dtype(dtype)
    _dequant_rows_kernel[grid](
        tiled_words(w), w.scales, offsets, out if ids is None else ids.reshape(-1), out, magic(w.bits, dt), n_rows, k,
        BITS=w.bits, GROUP=w.group_size, HAS_OFFSET=w.offsets is not None, HAS_IDS=ids is not None,
        BLOCK_R=block_r, BLOCK_K=block_k, DT=dt, num_warps=4,
    )
    return out
