"""y = x @ W^T for a QuantWeight on the CPU through the native kernel: the weight stays packed."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from llamaterm.kernels.cpu_native import threads
from llamaterm.kernels.qweight import QuantWeight

# From this many rows on (prefill chunks) one dense matmul over a transient fp32 copy beats a dot product per row
DENSE_FROM_ROWS = 16


def cpu_params(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and offsets as the kernel reads them: contiguous, both fp16 or both fp32 (exact either way)."""
    params = (w.scales, w.offsets) if w.offsets is not None else (w.scales,)
    dtype = torch.float16 if all(p.dtype == torch.float16 for p in params) else torch.float32
    scales, *offsets = (p.to(dtype).contiguous() for p in params)
    return scales, offsets[0] if offsets else None


def qmatmul_cpu(x: torch.Tensor, w: QuantWeight, lib: ctypes.CDLL) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] fp32."""
    n, k = w.shape
    if w.perm is not None:
        x = x[..., w.perm]
    rows = x.reshape(-1, k).contiguous()
    scales, offsets = w.prepared("cpu", cpu_params)
    packed = w.packed.contiguous()
    args = (packed.data_ptr(), scales.data_ptr(), 0 if offsets is None else offsets.data_ptr(),
            int(scales.dtype == torch.float16), w.bits, w.group_size)
    if rows.shape[0] >= DENSE_FROM_ROWS:
        dense = torch.empty(n, k)
        lib.dequantize(*args, k, n, dense.data_ptr(), threads())
        return F.linear(x, dense)
    y = torch.empty(rows.shape[0], n)
    lib.qmatmul(rows.data_ptr(), rows.shape[0], k, *args, n, y.data_ptr(), threads())
    return y.view(*x.shape[:-1], n)
