"""The one in-memory quantized weight type that every checkpoint format converts to.

A weight of shape [N, K] (out, in) holds unsigned integer values q of `bits` bits (4 or 8), grouped along K in
groups of `group_size` (the last group shorter when group_size does not divide K, as GPTQModel writes group 128
for 576-wide layers), with one scale per group and, for affine sources, one offset per group:

    w = scale * q + offset            (offsets present: Q4_1, Q5_1, Q4_K, Q5_K, AWQ, asymmetric GPTQ)
    w = scale * (q - 2**(bits - 1))   (offsets None: Q4_0, Q8_0, Q6_K, symmetric GPTQ; stores no offset bytes)

Values narrower than the container are re-centred at load so the formula holds (Q5_0: q + 112 in 8 bits).
A 4-bit weight with a codebook maps q through a fixed table instead of centring it: "e2m1" is MXFP4's
(OCP microscaling FP4: sign, two exponent bits, one mantissa bit), w = scale * E2M1[q], with the block's E8M0
scale 2**(e - 127) stored exactly in bf16 (a power of two; E8M0 and bf16 share fp32's exponent range).
An optional input permutation `perm` (GPTQ act-order) means y = x[:, perm] @ w.T.
4-bit values are packed two per byte along K: byte j of a row holds q[2j] in its low and q[2j+1] in its high
nibble. Scales and offsets are fp16 (fp32 where a source needs more precision to stay exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class QuantWeight:
    packed: torch.Tensor  # uint8 [N, K * bits // 8]
    scales: torch.Tensor  # [N, groups], groups = ceil(K / group_size)
    offsets: torch.Tensor | None  # [N, groups], or None for symmetric
    bits: int
    group_size: int
    shape: tuple[int, int]  # (N, K)
    perm: torch.Tensor | None = None  # int64 [K]
    codebook: str | None = None  # None: integers (see above); "e2m1": MXFP4's values, w = scale * E2M1[q]
    layout_only: bool = False  # the packed form was freed for the GPU layout (replace_packed)
    _dense: dict = field(default_factory=dict, repr=False, compare=False)
    _prepared: dict = field(default_factory=dict, repr=False, compare=False)  # kernel layouts, made on first use

    @staticmethod
    def from_values(
        q: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bits: int,
        group_size: int,
        perm: torch.Tensor | None = None,
        codebook: str | None = None,
    ) -> QuantWeight:
        """Build from unpacked integer values q [N, K] (any integer dtype, 0 <= q < 2**bits)."""
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if codebook is not None and (codebook not in CODEBOOKS or bits != 4 or offsets is not None):
            raise ValueError(f"codebook {codebook!r}: known ones are {list(CODEBOOKS)}, 4-bit and without offsets")
        n, k = q.shape
        groups = -(-k // group_size)
        if bits == 4 and k % 2:
            raise ValueError(f"K={k} is odd: 4-bit values pack in pairs")
        if scales.shape != (n, groups) or (offsets is not None and offsets.shape != scales.shape):
            raise ValueError(f"scales/offsets must be [{n}, {groups}], got {tuple(scales.shape)}")
        q = q.to(torch.uint8).contiguous()
        if bits == 4:  # each little-endian byte pair read as one int16 is q[2j] | q[2j+1] << 8: contiguous ops only
            pairs = q.view(torch.int16)
            q = ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)
        packed = q
        return QuantWeight(packed.contiguous(), scales, offsets, bits, group_size, (n, k), perm, codebook)

    def values(self) -> torch.Tensor:
        """The unpacked integer values q as uint8 [N, K]."""
        assert not self.layout_only, "the packed form was freed: the kernels' layout holds the values"
        if self.bits == 8:
            return self.packed
        n, k = self.shape
        return torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """w [N, K] in `dtype`, computed in fp32 (exact for fp16 scales and offsets)."""
        if self.layout_only:
            from llamaterm.kernels.qweight_triton import dequantize_rows_triton

            return dequantize_rows_triton(self, None, dtype)
        return dequantize_rows(self.values(), self.scales, self.offsets, self.bits, self.group_size, self.codebook).to(
            dtype
        )

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized copy, made once and kept: the CPU reference path multiplies with it."""
        if dtype not in self._dense:
            self._dense[dtype] = self.dequantize(dtype)
        return self._dense[dtype]

    def kept_dense(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The dense copy in `dtype` if one was made (dense()), else None: GPU matmuls over many rows use it."""
        return self._dense.get(dtype)

    def prepared(self, key: str, make):
        """A kernel's own layout of this weight, made once by `make(self)` and kept (kernels/qweight_triton.py)."""
        if key not in self._prepared:
            self._prepared[key] = make(self)
        return self._prepared[key]

    def replace_packed(self, key: str, make) -> None:
        """Make the kernels' layout `key` (as prepared) and free the packed values, scales and offsets for it: on the
        GPU the kernels read that layout alone, dequantize() too, and keeping both would hold the weights twice. The
        freed fields stay as empty tensors of their dtype and device (the format is still read from them)."""
        self.prepared(key, make)
        empty = lambda t: t.new_empty((0,) * t.dim())  # noqa: E731
        self.packed, self.scales = empty(self.packed), empty(self.scales)
        self.offsets = None if self.offsets is None else empty(self.offsets)
        self.layout_only = True

    def nbytes(self) -> int:
        """The bytes it holds: the packed form, or the kernels' layouts that replaced it."""
        tensors = [self.packed, self.scales, self.offsets]
        if self.layout_only:
            tensors = [t for layout in self._prepared.values() for t in layout]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (embedding lookup) without dequantizing the whole matrix."""
        return self.take_rows(ids.reshape(-1)).dequantize(dtype)

    def take_rows(self, index: torch.Tensor | slice) -> QuantWeight:
        """Rows `index` (a tensor of row ids, in that order, or a slice: views, no copy), still quantized (exact:
        each row is stored whole). An expert of a stack of experts is a slice of its rows."""
        assert not self.layout_only, "the packed form was freed: take rows before replace_packed"
        offsets = None if self.offsets is None else self.offsets[index]
        packed = self.packed[index]
        return QuantWeight(
            packed,
            self.scales[index],
            offsets,
            self.bits,
            self.group_size,
            (packed.shape[0], self.shape[1]),
            self.perm,
            self.codebook,
        )

    def to(self, device: torch.device | str) -> QuantWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        perm = None if self.perm is None else self.perm.to(device)
        return QuantWeight(
            self.packed.to(device),
            self.scales.to(device),
            offsets,
            self.bits,
            self.group_size,
            self.shape,
            perm,
            self.codebook,
        )

    @staticmethod
    def cat(weights: list[QuantWeight]) -> QuantWeight:
        """Stack along N (fuses q/k/v or gate/up into one matmul). All parts must share the format."""
        first = weights[0]
        same = all(
            (w.bits, w.group_size, w.shape[1], w.offsets is None, w.perm is None, w.scales.dtype, w.codebook)
            == (
                first.bits,
                first.group_size,
                first.shape[1],
                first.offsets is None,
                True,
                first.scales.dtype,
                first.codebook,
            )
            for w in weights
        )
        if not same:
            raise ValueError("cannot concatenate quantized weights of different formats")
        offsets = None
        if first.offsets is not None:  # then every part has offsets: `same` checked it
            offsets = torch.cat([w.offsets for w in weights if w.offsets is not None])
        return QuantWeight(
            torch.cat([w.packed for w in weights]),
            torch.cat([w.scales for w in weights]),
            offsets,
            first.bits,
            first.group_size,
            (sum(w.shape[0] for w in weights), first.shape[1]),
            codebook=first.codebook,
        )


# The value of each 4-bit code under a codebook: MXFP4's E2M1 (bit 3 the sign; then +-0, 0.5, 1, 1.5, 2, 3, 4, 6)
CODEBOOKS = {"e2m1": (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)}


def dequantize_rows(q, scales, offsets, bits, group_size, codebook: str | None = None) -> torch.Tensor:
    n, k = q.shape
    groups = scales.shape[1]  # a short last group is padded to a whole one, then cut off
    if codebook is not None:
        qf = torch.tensor(CODEBOOKS[codebook], device=q.device)[q.long()]
    else:
        qf = q.to(torch.float32)
    qf = torch.nn.functional.pad(qf, (0, groups * group_size - k)).view(n, groups, group_size)
    s = scales.to(torch.float32).unsqueeze(-1)
    if codebook is not None:
        w = s * qf
    elif offsets is None:
        w = s * (qf - 2 ** (bits - 1))
    else:
        w = s * qf + offsets.to(torch.float32).unsqueeze(-1)
    return w.view(n, groups * group_size)[:, :k]
