"""The Python side of the CPU's native kernels (kernels/cpu_native.c): each takes and returns fp32 CPU tensors
and matches the torch reference of the same op in kernels/ (tests/test_kernels_cpu.py)."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from llamaterm.kernels.cpu_native import library, threads
from llamaterm.kernels.qweight import QuantWeight

# From this many rows on (prefill chunks) one dense matmul over a transient fp32 copy beats a dot product per row
DENSE_FROM_ROWS = 16


def native_lib(t: torch.Tensor) -> ctypes.CDLL | None:
    """The native library where it serves `t` (an fp32 CPU tensor), else None: the caller takes the reference."""
    return library() if t.device.type == "cpu" and t.dtype == torch.float32 else None


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def cpu_params(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and offsets as the kernel reads them: contiguous, both fp16 or both fp32 (exact either way)."""
    params = (w.scales, w.offsets) if w.offsets is not None else (w.scales,)
    dtype = torch.float16 if all(p.dtype == torch.float16 for p in params) else torch.float32
    scales, *offsets = (p.to(dtype).contiguous() for p in params)
    return scales, offsets[0] if offsets else None


def qmatmul_cpu(x: torch.Tensor, w: QuantWeight, lib: ctypes.CDLL) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ W^T; K and the group size multiples of 16 (the last group may be short); MXFP4
    too."""
    n, k = w.shape
    if w.perm is not None:
        x = x[..., w.perm]
    rows = x.reshape(-1, k).contiguous()
    scales, offsets = w.prepared("cpu", cpu_params)
    packed = w.packed.contiguous()
    f16, e2m1 = int(scales.dtype == torch.float16), int(w.codebook == "e2m1")
    args = (ptr(packed), ptr(scales), ptr(offsets), f16, w.bits, e2m1, w.group_size)
    if rows.shape[0] >= DENSE_FROM_ROWS:
        dense = torch.empty(n, k)
        lib.dequantize(*args, k, n, ptr(dense), threads())
        return F.linear(x, dense)
    y = torch.empty(rows.shape[0], n)
    lib.qmatmul(ptr(rows), rows.shape[0], k, *args, n, ptr(y), threads())
    return y.view(*x.shape[:-1], n)


def rms_norm_cpu(x, weight, eps, residual, lib):
    x = x.contiguous()
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    residual = None if residual is None else residual.contiguous()
    lib.rms_norm(
        ptr(x),
        ptr(residual),
        ptr(weight.contiguous()),
        eps,
        x.numel() // x.shape[-1],
        x.shape[-1],
        ptr(out),
        ptr(total),
    )
    return out, total


def rope_cpu(q, k, positions, inv_freq, lib):
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    positions, inv_freq = positions.to(torch.int64).contiguous(), inv_freq.float().contiguous()
    inv_stride = inv_freq.shape[-1] if inv_freq.dim() == 2 else 0  # a row per token, or one for all
    lib.rope(
        ptr(q),
        ptr(k),
        ptr(q_out),
        ptr(k_out),
        ptr(positions),
        ptr(inv_freq),
        inv_stride,
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
    )
    return q_out, k_out


def act_and_mul_cpu(gate_up, activation, lib):
    """activation: one of kernels/activation.py's ACTIVATIONS (the C function {activation}_and_mul)."""
    gate_up = gate_up.contiguous()
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i)
    getattr(lib, f"{activation}_and_mul")(ptr(gate_up), gate_up.numel() // gate_up.shape[-1], i, ptr(out))
    return out


def write_kv_cpu(k, v, k_cache, v_cache, slot_mapping, lib):
    """Into the caches in place, as kernels/attention.py's write_kv_ref (the caches must be contiguous)."""
    k, v = k.to(k_cache.dtype).contiguous(), v.to(v_cache.dtype).contiguous()
    row = k_cache.shape[2] * k_cache.shape[3]
    lib.write_kv(
        ptr(k), ptr(v), ptr(k_cache), ptr(v_cache), ptr(slot_mapping.to(torch.int64).contiguous()), k.shape[0], row
    )


def paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, window, sinks, lib):
    q, tables = q.contiguous(), block_tables.to(torch.int32).contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    out = torch.empty_like(q)
    lib.paged_attention(
        ptr(q),
        ptr(k_cache.contiguous()),
        ptr(v_cache.contiguous()),
        ptr(tables),
        tables.shape[1],
        ptr(context_lens.to(torch.int64).contiguous()),
        ptr(query_start_loc.to(torch.int64).contiguous()),
        context_lens.shape[0],
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        window or 0,
        ptr(sinks),
        ptr(out),
    )
    return out
