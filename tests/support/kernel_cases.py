"""Shared inputs of the kernel tests (tests/kernels/test_kernels_triton.py, tests/kernels/test_kernels_cpu.py):
random quantized weights in every format (MXFP4 too), real MoE layers' experts, and paged KV caches with NaN
wherever no sequence owns a slot."""

import math

import torch

from llamaterm.kernels.moe import Experts
from llamaterm.kernels.qweight import QuantWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), "unwritten (NaN) or invalid elements"
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def random_qweight(n, k, bits, group, offsets, perm, scale_dtype=torch.float16, device=DEVICE) -> QuantWeight:
    """A group that does not divide k leaves a short last group."""
    q = torch.randint(0, 2**bits, (n, k))
    groups = -(-k // group)
    scales = (torch.rand(n, groups) * 0.02 + 0.002).to(scale_dtype)
    offs = (torch.randn(n, groups) * 0.02).to(scale_dtype) if offsets else None
    return QuantWeight.from_values(q, scales, offs, bits, group, torch.randperm(k) if perm else None).to(device)


def random_mxfp4(n, k, exponents=(-15, 10), device=DEVICE) -> QuantWeight:
    """MXFP4 (codebook "e2m1", group 32): random codes, and scales 2**e in bf16 with e in [exponents) (by default
    the E8M0 scales of weights between about 1e-4 and 600)."""
    q = torch.randint(0, 16, (n, k))
    scales = torch.exp2(torch.randint(*exponents, (n, -(-k // 32))).float()).to(torch.bfloat16)
    return QuantWeight.from_values(q, scales, None, 4, 32, codebook="e2m1").to(device)


# (bits, k, group, offsets, perm) whose last group is short: SmolLM2's 576 in groups of 128 (4.5), and smaller
SHORT_GROUPS = [
    (4, 576, 128, True, False),
    (4, 576, 128, False, True),
    (8, 80, 32, True, True),
    (8, 576, 128, False, False),
    (4, 48, 32, False, False),
]
# (bits, group, offsets, perm): every group size, both widths, offsets and act-order each on and off
FORMATS = [
    (4, 32, False, False),
    (4, 64, True, True),
    (4, 128, False, True),
    (4, 128, True, False),
    (8, 16, False, False),
    (8, 32, True, True),
    (4, 16, True, False),
    (8, 128, False, True),
]


def random_paged_cache(ctxs, n_kv, head_dim, page, dtype, extra_blocks=3, device=DEVICE):
    """A cache with NaN in every slot no sequence owns, and block tables padded with garbage ids."""
    blocks = [-(-c // page) for c in ctxs]
    num_blocks = sum(blocks) + extra_blocks
    k_cache = torch.full((num_blocks, page, n_kv, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = k_cache.clone()
    ids = torch.randperm(num_blocks, device=device).int()
    tables = torch.full((len(ctxs), max(blocks) + 2), 10**6, dtype=torch.int32, device=device)
    used = 0
    for b, (c, nb) in enumerate(zip(ctxs, blocks, strict=True)):
        tables[b, :nb] = ids[used : used + nb]
        used += nb
        slots = (tables[b, :nb, None].long() * page + torch.arange(page, device=device)).flatten()[:c]
        k_cache.view(-1, n_kv, head_dim)[slots] = torch.randn(c, n_kv, head_dim, device=device).to(dtype)
        v_cache.view(-1, n_kv, head_dim)[slots] = torch.randn(c, n_kv, head_dim, device=device).to(dtype)
    return k_cache, v_cache, tables


def free_outside_window(k_cache, v_cache, tables, ctxs, qlens, window):
    """What the engine does with a sliding window (BlockManager.slide): the blocks wholly before the window of each
    sequence's first query are given back, here NaN in the cache and a garbage id in the table, so a kernel that
    reads one fails."""
    page = k_cache.shape[1]
    for b, (ctx, n) in enumerate(zip(ctxs, qlens, strict=True)):
        for i in range(max(0, ctx - n - window + 1) // page):
            k_cache[tables[b, i].long()] = v_cache[tables[b, i].long()] = float("nan")
            tables[b, i] = 10**6


def expert_weight(n, k, bits, group, codebook=None, device=DEVICE) -> QuantWeight:
    """A stack of experts' rows [n, k] at real sizes: random codes, with scales that keep the products of N(0, 1)
    inputs near 1: 4-bit with offsets (as Q4_K gives), 8-bit symmetric (Q6_K's values in 8 bits), or MXFP4."""
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device=device)
    if codebook == "e2m1":  # E2M1 codes have a spread of about 2.9
        scales = torch.full((n, k // group), 2.0 ** round(-0.5 * math.log2(k) - 1.5), device=device)
        return QuantWeight.from_values(q, scales.to(torch.bfloat16), None, bits, group, codebook=codebook)
    spread = 4.6 if bits == 4 else 74.0  # of uniform 4-bit and 8-bit codes
    scales = (torch.rand(n, k // group, device=device) + 0.5) / (spread * k**0.5)
    offsets = (-scales * 8).half() if bits == 4 else None
    return QuantWeight.from_values(q, scales.half(), offsets, bits, group)


def moe_layer(model: str, device=DEVICE) -> tuple[Experts, int]:
    """(a layer's experts, top-k): Qwen3-30B-A3B's ("qwen3": 128 experts, H 2048, I 768; Q4_K-like gate_up, 8-bit
    group-16 down) or gpt-oss-20b's ("gpt-oss": 32 experts, H = I = 2880, MXFP4 with biases, the clamped SwiGLU).
    Both renormalize the top-k weights."""
    if model == "qwen3":
        e, h, i = 128, 2048, 768
        gate_up, down = expert_weight(e * 2 * i, h, 4, 32, device=device), expert_weight(e * h, i, 8, 16, device=device)
        return Experts(e, [gate_up], down, "silu"), 8
    e, h, i = 32, 2880, 2880
    gate_up = expert_weight(e * 2 * i, h, 4, 32, "e2m1", device)
    down = expert_weight(e * h, i, 4, 32, "e2m1", device)
    biases = torch.randn(e, 2 * i, device=device) * 0.1, torch.randn(e, h, device=device) * 0.1
    return Experts(e, [gate_up], down, "swiglu_oai", *biases), 4
