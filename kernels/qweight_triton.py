"""The GPU layout of a QuantWeight, the unpack step the quantized kernels share, and a kernel that dequantizes rows
(embedding lookup; the whole matrix before a prefill-size cuBLAS matmul).

Layout (`gpu_layout`: a model on CUDA makes it at load, in place of the packed form). K is cut into steps of GROUP
bytes per row: one group of 8-bit values, or two groups of 4-bit values, the first group in the low nibbles and the
second in the high nibbles of the same GROUP bytes. So a byte tile unpacks into two value tiles of the same shape
with one AND or one shift: elementwise, with no reshape. That matters because Triton then moves the dot-operand
layout conversion up to the byte load: the bytes go global -> shared (cp.async, pipelined) -> registers in the MMA
operand layout, and the values are made there. Steps are stored step-major, [steps, N_pad, GROUP], and the scales
(and offsets) the same way, [steps, N_pad, groups per step], zero-padded so that the kernels load them without
masks; a step's two fp16 scales are one 32-bit word.

Values are made without int->float conversions (a quarter of the FMA rate): two bytes are spread into the two
halves of a 32-bit word (PRMT) and their fields OR-ed into the exponent pattern of 1024.0 (fp16) or 128.0 (bf16,
4-bit only) with one LOP3, giving the exact pair (magic + q_i, magic + q_j); one packed subtract centres it. Each
inline-asm call takes the 2 or 4 bytes a thread holds in one register and returns both nibbles' values, so Triton
need not split registers into bytes for it: the matmul's main loop (8-token tile, sm_90 SASS) went from 3.7 to 2.6
instructions per 4-bit weight. MXFP4's E2M1 codes are moved into fp16's bit positions the same way (e2m1_asm).
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.triton_util import arith_dtype


@triton.constexpr_function
def unpack_asm(bits: int, bf16: bool, pack: int) -> str:
    """PTX for `pack` bytes (2 or 4; input register $n last) -> the magic patterns of their values, two per output
    register: 4-bit, the low nibbles' registers, then the high nibbles'; 8-bit, the bytes'. PRMT spreads two bytes
    into the low bytes of a word's halves (8-bit: with 0x64, the high byte of 1024.0, in the high bytes); LOP3 keeps
    one nibble of each half and ORs in the magic (0xea: (a & b) | c). For fp16 the high nibble stays in place,
    magic + 16 q, scaled afterwards with one FMA; bf16 has too few mantissa bits for that, so it shifts first."""
    words = ["a", "c"][: pack // 2]
    src = f"${len(words) * (2 if bits == 4 else 1)}"
    spread = ["0x4140", "0x4342"]  # bytes (0, 1) and (2, 3)
    if bits == 8:
        return " ".join(f"prmt.b32 ${i}, {src}, 0x64646464, {spread[i]};" for i in range(len(words)))
    magic, high = ("0x43004300", "0x000F000F") if bf16 else ("0x64006400", "0x00F000F0")
    ops = [f"prmt.b32 {w}, {src}, 0, {spread[i]};" for i, w in enumerate(words)]
    ops += [f"lop3.b32 ${i}, {w}, 0x000F000F, {magic}, 0xea;" for i, w in enumerate(words)]
    ops += [f"shr.u32 {w}, {w}, 4;" for w in words if bf16]
    ops += [f"lop3.b32 ${len(words) + i}, {w}, {high}, {magic}, 0xea;" for i, w in enumerate(words)]
    return "{ .reg .b32 a, c; " + " ".join(ops) + " }"


@triton.constexpr_function
def e2m1_asm(pack: int) -> str:
    """PTX for `pack` bytes of MXFP4 codes -> the fp16 patterns of E2M1[q] * 2**-14, two per output register, the
    low nibbles' registers then the high nibbles': a nibble's magnitude bits (exponent and mantissa) go to bits
    9-11 of a half, its sign bit to bit 15 (PRMT spreads two bytes into the halves; two shifts, an AND, one LOP3)."""
    words = ["a", "c"][: pack // 2]
    src = f"${2 * len(words)}"
    spread = ["0x4140", "0x4342"]  # bytes (0, 1) and (2, 3)
    ops = [f"prmt.b32 {w}, {src}, 0, {spread[i]};" for i, w in enumerate(words)]
    # the shifts that bring each field in place (no tuple in the loop's target: Triton 3.6 cannot hash that)
    for nibble, shifts in enumerate([(9, 12), (5, 8)]):
        mag, sign = shifts
        for i, w in enumerate(words):
            ops += [f"shl.b32 t, {w}, {mag};", f"shl.b32 u, {w}, {sign};", "and.b32 u, u, 0x80008000;"]
            ops += [f"lop3.b32 ${nibble * len(words) + i}, t, 0x0E000E00, u, 0xea;"]
    return "{ .reg .b32 a, c, t, u; " + " ".join(ops) + " }"


@triton.constexpr_function
def unpack_constraints(bits: int, pack: int) -> str:
    return ",".join(["=r"] * (pack // 2) * (2 if bits == 4 else 1) + ["r"])


@triton.jit
def centred_values(
    b,
    BITS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    CODEBOOK: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    PACK: tl.constexpr,
):
    """Bytes b (uint8) -> (q - centre) in DT, exact, as a pair: 4-bit, the values of the low and of the high
    nibbles; 8-bit, the values twice. The centre is 2**(BITS-1) for symmetric weights, 0 with offsets; with the
    "e2m1" codebook the values are E2M1[q] (kernels/qweight.py's CODEBOOKS).
    ASM: the PTX path, PACK bytes per call. Inline asm is elementwise, so any PACK is correct in any register
    layout; the fast one matches how many consecutive bytes each thread holds (4 in a blocked or an mma.sync
    operand layout, 2 in a wgmma register operand), so that they arrive as one register. Without ASM (the CPU
    interpreter, which cannot run PTX) plain integer ops build the same bit patterns."""
    CENTER: tl.constexpr = 0 if HAS_OFFSET else 1 << (BITS - 1)
    BF16: tl.constexpr = DT == tl.bfloat16
    if CODEBOOK == "e2m1":
        # E2M1 is sign, 2 exponent bits, 1 mantissa bit: in fp16's bit positions it reads as E2M1[q] * 2**-14 (0.5
        # a subnormal, which fp16 arithmetic keeps), and one multiply by 2**14 makes the value, exact (also in bf16)
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                e2m1_asm(PACK), unpack_constraints(4, PACK), [b], dtype=(tl.int16, tl.int16), is_pure=True, pack=PACK
            )
        else:
            lo = ((b & 7).to(tl.int16) << 9) | ((b & 8).to(tl.int16) << 12)
            hi = ((b & 0x70).to(tl.int16) << 5) | ((b & 0x80).to(tl.int16) << 8)
        lo = lo.to(tl.float16, bitcast=True) * 16384.0
        hi = hi.to(tl.float16, bitcast=True) * 16384.0
        return lo.to(DT), hi.to(DT)
    if BITS == 4:
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                unpack_asm(BITS, BF16, PACK),
                unpack_constraints(BITS, PACK),
                [b],
                dtype=(tl.int16, tl.int16),
                is_pure=True,
                pack=PACK,
            )
        elif BF16:
            lo, hi = (b & 0xF).to(tl.int16) | 0x4300, (b >> 4).to(tl.int16) | 0x4300
        else:
            lo, hi = (b & 0xF).to(tl.int16) | 0x6400, (b & 0xF0).to(tl.int16) | 0x6400
        if BF16:  # 128 + q: exact in bf16 for q < 128
            return (
                lo.to(tl.bfloat16, bitcast=True) - (128.0 + CENTER),
                hi.to(tl.bfloat16, bitcast=True) - (128.0 + CENTER),
            )
        # 1024 + q (low nibble) and 1024 + 16 q (high nibble): exact in fp16
        lo = lo.to(tl.float16, bitcast=True) - (1024.0 + CENTER)
        hi = hi.to(tl.float16, bitcast=True) * 0.0625 - (64.0 + CENTER)  # one FMA
        return lo.to(DT), hi.to(DT)
    if ASM:  # 1024 + q: exact in fp16 for q < 1024; then to DT, exact for |q - centre| < 256
        v = tl.inline_asm_elementwise(
            unpack_asm(BITS, BF16, PACK), unpack_constraints(BITS, PACK), [b], dtype=tl.int16, is_pure=True, pack=PACK
        )
    else:
        v = b.to(tl.int16) | 0x6400
    v = (v.to(tl.float16, bitcast=True) - (1024.0 + CENTER)).to(DT)
    return v, v


class GpuLayout(NamedTuple):
    values: torch.Tensor  # uint8 [steps, N_pad, GROUP]
    scales: torch.Tensor  # [steps, N_pad, groups per step]
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
    pad = lambda t: (
        torch.nn.functional.pad(t, (0, steps * per_step - t.shape[1], 0, n_pad - n))
        .view(n_pad, steps, per_step)
        .transpose(0, 1)
        .contiguous()
    )
    return GpuLayout(b.transpose(0, 1).contiguous(), pad(w.scales), None if w.offsets is None else pad(w.offsets))


@triton.jit
def step_params(p_ptr, s, n_pad, rows, mask, GPS: tl.constexpr):
    """Scales (or offsets) of step s for `rows`, in fp32: groups (2s, 2s + 1) for 4-bit, (s, s) for 8-bit. A pair
    of fp16 or bf16 is read as one 32-bit word: wide enough for cp.async, so Triton's pipeliner prefetches it with
    the bytes (it leaves 16-bit loads in the loop, where each step would wait for their latency). A bf16 is the top
    half of the fp32 of the same value."""
    if GPS == 2 and p_ptr.dtype.element_ty == tl.float16:
        word = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + s * n_pad + rows, mask=mask, other=0)
        lo = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    elif GPS == 2 and p_ptr.dtype.element_ty == tl.bfloat16:
        word = tl.load(p_ptr.to(tl.pointer_type(tl.int32)) + s * n_pad + rows, mask=mask, other=0)
        lo = (word << 16).to(tl.float32, bitcast=True)
        hi = (word & -65536).to(tl.float32, bitcast=True)
    else:
        lo = tl.load(p_ptr + (s * n_pad + rows) * GPS, mask=mask, other=0)
        hi = lo
        if GPS == 2:
            hi = tl.load(p_ptr + (s * n_pad + rows) * GPS + 1, mask=mask, other=0)
    return lo.to(tl.float32), hi.to(tl.float32)


def gpu_layout(w: QuantWeight) -> GpuLayout:
    """w in the GPU layout (see the module docstring), made once and kept on w."""
    return w.prepared("gpu_layout", _make_layout)


def keep_gpu_layout_only(w: QuantWeight) -> None:
    """w's GPU layout made now, in place of its packed form (QuantWeight.replace_packed)."""
    w.replace_packed("gpu_layout", _make_layout)


def use_asm() -> bool:
    """Inline PTX for the unpack, except under TRITON_INTERPRET (the CPU interpreter cannot run PTX)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _dequant_rows_kernel(
    w_ptr,
    s_ptr,
    o_ptr,
    ids_ptr,
    out_ptr,
    n_rows,
    N,
    K,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    CODEBOOK: tl.constexpr,
    HAS_IDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
):
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
    values = centred_values(b, BITS, HAS_OFFSET, CODEBOOK, DT, ASM, 4)
    scales = step_params(s_ptr, s, n_pad, rows, row_mask, GPS)
    if HAS_OFFSET:
        offsets = step_params(o_ptr, s, n_pad, rows, row_mask, GPS)
    for h in tl.static_range(GPS):
        w = values[h].to(tl.float32) * scales[h][:, None]
        if HAS_OFFSET:
            w += offsets[h][:, None]
        k = (s * GPS + h) * GROUP + j
        tl.store(
            out_ptr + r[:, None].to(tl.int64) * K + k[None, :],
            w.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & (k < K)[None, :],
        )


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
        layout.values,
        layout.scales,
        layout.scales if layout.offsets is None else layout.offsets,
        out if ids is None else ids.reshape(-1),
        out,
        n_rows,
        n,
        k,
        BITS=w.bits,
        GROUP=w.group_size,
        HAS_OFFSET=w.offsets is not None,
        CODEBOOK=w.codebook,
        HAS_IDS=ids is not None,
        BLOCK_R=block_r,
        DT=arith_dtype(dtype),
        ASM=use_asm(),
        num_warps=4,
    )
    return out
