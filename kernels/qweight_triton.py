"""The GPU layout of a QuantWeight, the unpack step the quantized kernels share, and a kernel that dequantizes rows
(embedding lookup; the whole matrix before a prefill-size cuBLAS matmul).

Layout (`gpu_layout`, made on first use and kept on the QuantWeight). K is cut into steps of GROUP bytes per row:
one group of 8-bit values, or two groups of 4-bit values, the first group in the low nibbles and the second in the
high nibbles of the same GROUP bytes. So a byte tile unpacks into two value tiles of the same shape with one AND or
one shift: elementwise, with no reshape. That matters because Triton then moves the dot-operand layout conversion
up to the byte load: the bytes go global -> shared (cp.async, pipelined) -> registers in the MMA operand layout,
and the values are made there. Steps are stored step-major, [steps, N_pad, GROUP], and the scales (and offsets)
group-major, [groups_pad, N_pad], zero-padded so that the kernels load them without masks.

Values are made without int->float conversions (a quarter of the FMA rate): two bytes are spread into the two
halves of a 32-bit word (PRMT) and their fields OR-ed into the exponent pattern of 1024.0 (fp16) or 128.0 (bf16,
4-bit only) with one LOP3, giving the exact pair (magic + q_i, magic + q_j); one packed subtract centres it.
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.qweight import QuantWeight
from kernels.triton_util import arith_dtype


def _spread_asm(shift: bool, magic: str) -> tl.constexpr:
    """PTX for two bytes (low 16 bits of $1) -> the magic pair of their low (or, with shift, high) nibbles."""
    shr = "shr.u32 t, t, 4; " if shift else ""
    return tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x4140; " + shr
                        + "lop3.b32 $0, t, 0x000F000F, " + magic + ", 0xea; }")  # 0xea: (a & b) | c


ASM_BF16_LO, ASM_BF16_HI = _spread_asm(False, "0x43004300"), _spread_asm(True, "0x43004300")
ASM_F16_LO, ASM_F16_HI = _spread_asm(False, "0x64006400"), _spread_asm(True, "0x64006400")


@triton.jit
def centred_values(b, h: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr, DT: tl.constexpr,
                   ASM: tl.constexpr):
    """Bytes b (uint8) -> q - centre in DT, exact, for field h of each byte (4-bit: 0 low nibble, 1 high).
    The centre is 2**(BITS-1) for symmetric weights, 0 with offsets. ASM: the PTX path (not under the CPU
    interpreter, which computes the same bit patterns with plain integer ops)."""
    CENTER: tl.constexpr = 0 if HAS_OFFSET else 1 << (BITS - 1)
    if BITS == 4 and DT == tl.bfloat16:  # 128 + q: exact in bf16 for q < 128
        if ASM:
            v = tl.inline_asm_elementwise(ASM_BF16_HI if h == 1 else ASM_BF16_LO, "=r,r", [b], dtype=tl.int16,
                                          is_pure=True, pack=2)
        else:
            v = ((b >> 4) if h == 1 else (b & 0xF)).to(tl.int16) | 0x4300
        return v.to(tl.bfloat16, bitcast=True) - (128.0 + CENTER)
    if BITS == 4 and ASM:
        v = tl.inline_asm_elementwise(ASM_F16_HI if h == 1 else ASM_F16_LO, "=r,r", [b], dtype=tl.int16,
                                      is_pure=True, pack=2)
    elif BITS == 4:
        v = ((b >> 4) if h == 1 else (b & 0xF)).to(tl.int16) | 0x6400
    else:  # 1024 + q is exact in fp16 for q < 1024; then to DT, exact for |q - centre| < 256
        v = b.to(tl.int16) | 0x6400
    return (v.to(tl.float16, bitcast=True) - (1024.0 + CENTER)).to(DT)


class GpuLayout(NamedTuple):
    values: torch.Tensor  # uint8 [steps, N_pad, GROUP]
    scales: torch.Tensor  # [steps * groups per step, N_pad]
    offsets: torch.Tensor | None  # like scales, or None (symmetric)


ROW_PAD = tl.constexpr(16)  # N is padded to a multiple of this


def _make_layout(w: QuantWeight) -> GpuLayout:
    n, k = w.shape
    g = w.group_size
    per_step = 8 // w.bits  # groups per step
    steps = -(-k // (g * per_step))
    n_pad = -(-n // ROW_PAD.value) * ROW_PAD.value
    q = torch.nn.functional.pad(w.values(), (0, steps * g * per_step - k, 0, n_pad - n)).view(n_pad, steps, per_step, g)
    b = q[:, :, 0] | (q[:, :, 1] << 4) if w.bits == 4 else q[:, :, 0]
    pad = lambda t: torch.nn.functional.pad(t.t(), (0, n_pad - n, 0, steps * per_step - k // g)).contiguous()
    return GpuLayout(b.transpose(0, 1).contiguous(), pad(w.scales), None if w.offsets is None else pad(w.offsets))


def gpu_layout(w: QuantWeight) -> GpuLayout:
    """w in the GPU layout (see the module docstring), made on first use and kept on w."""
    return w.prepared("gpu_layout", _make_layout)


def use_asm() -> bool:
    """Inline PTX for the unpack, except under TRITON_INTERPRET (the CPU interpreter cannot run PTX)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _dequant_rows_kernel(w_ptr, s_ptr, o_ptr, ids_ptr, out_ptr, n_rows, N, K,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_IDS: tl.constexpr,
                         BLOCK_R: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    GPS: tl.constexpr = 8 // BITS
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.program_id(1)
    row_mask = r < n_rows
    rows = r
    if HAS_IDS:
        rows = tl.load(ids_ptr + r, mask=row_mask, other=0)
    n_pad = tl.cdiv(N, ROW_PAD) * ROW_PAD
    j = tl.arange(0, GROUP)
    b = tl.load(w_ptr + (s * n_pad + rows.to(tl.int64))[:, None] * GROUP + j[None, :], mask=row_mask[:, None], other=0)
    for h in tl.static_range(GPS):
        g = s * GPS + h
        v = centred_values(b, h, BITS, HAS_OFFSET, DT, ASM).to(tl.float32)
        w = v * tl.load(s_ptr + g * n_pad + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_OFFSET:
            w += tl.load(o_ptr + g * n_pad + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        k = g * GROUP + j
        tl.store(out_ptr + r[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (k < K)[None, :])


def dequantize_rows_triton(w: QuantWeight, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of w dequantized to dtype [len(ids), K]; ids None means all rows (w.dequantize(dtype))."""
    n, k = w.shape
    n_rows = n if ids is None else ids.numel()
    out = torch.empty(n_rows, k, dtype=dtype, device=w.packed.device)
    if n_rows == 0:
        return out
    layout = gpu_layout(w)
    block_r = max(1, 4096 // w.group_size)  # ~4k bytes per program
    grid = (triton.cdiv(n_rows, block_r), layout.values.shape[0])
    _dequant_rows_kernel[grid](
        layout.values, layout.scales, layout.scales if layout.offsets is None else layout.offsets,
        out if ids is None else ids.reshape(-1), out, n_rows, n, k,
        BITS=w.bits, GROUP=w.group_size, HAS_OFFSET=w.offsets is not None, HAS_IDS=ids is not None,
        BLOCK_R=block_r, DT=arith_dtype(dtype), ASM=use_asm(), num_warps=4,
    )
    return out
