"""The routed experts on CUDA (semantics in kernels/moe.py): four launches a layer, no host sync, so a step's MoE
layers stay inside its CUDA graphs.

1. route_triton: router logits [M, E] -> the top-k experts and their weights, one program per block of rows.
2. align: the step's P = M * k (row, slot) pairs, numbered p = row * k + slot, sorted by expert (in p order within
   an expert, so results never depend on timing), each expert's run padded to a whole number of BLOCK_M tiles
   (vLLM's moe_align_block_size). One program per expert: each counts every pair's expert (tl.histogram), finds
   its own run's first tile from the counts of the experts before it, and writes its pairs there, then its tiles'
   expert. The grid of the matmuls is fixed by M, k and E alone: at most cdiv(P, BLOCK_M) + min(E, P) tiles have
   pairs (each expert with pairs adds at most one partial tile); tiles past the real count are marked -1 and their
   programs exit at once.
3. The gate_up matmul: a program owns one tile of pairs (one expert) and BLOCK_N of its features, and runs the
   dense matmul's quantized main loop (kernels/linear_triton.py's qdot) over that expert's gate rows and up rows of
   the stacked weight (the two parts of a split gate and up alike); the epilogue adds the biases and writes
   act(gate) * up per pair, h [P, I].
4. The down matmul over h: the epilogue adds the bias and stores each pair's y in x's dtype (as the unfused
   reference rounds it); the last of a row's k pairs to finish a feature tile (a counter per row and tile, as the
   split-K reduction in kernels/linear_triton.py) sums the row's k partials times their routing weights, in slot
   order, in fp32, and writes out [M, H]: a row's result never depends on which other rows share the step.

Decode (about one pair per chosen expert) reads only the chosen experts' rows, once: the 8-pair tile and the
mma.sync path that the dense matmul takes for up to 8 tokens. From a few pairs per expert on, wider tiles make it a
grouped GEMM. Expert weights may also be dense fp16/bf16 tensors (the same kernel, a plain K loop).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llamaterm.kernels import triton_util
from llamaterm.kernels.activation_triton import gated
from llamaterm.kernels.linear_triton import qdot
from llamaterm.kernels.moe import Experts, Weight
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import gpu_layout, use_asm
from llamaterm.kernels.triton_util import after_previous, launch_next, wait_previous

DENSE_BLOCK_K = 64  # K per loop step for dense experts


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # pairs per tile: 8 (mma.sync), or 16 and up (wgmma)
    block_n_gate_up: int  # features per gate_up tile (each a gate row and an up row)
    block_n_down: int  # output features per down tile
    num_warps: int
    num_stages: int


def pick_config(pairs: int, n_experts: int) -> MoeConfig:
    """Tiles by the pairs a chosen expert gets if the pairs spread evenly; a function of M, k and E only (the
    grid's size must be, for CUDA graphs), and the same for every step of up to about 8 pairs per expert, so
    that a row's result does not depend on the batch. Decode tiles: moe_bench.py's --sweep (H100). The 8-pair tile
    (mma.sync, m16n8) takes 2 warps: 16 weight rows each in a 32-row gate or up tile (4 warps would compute the
    same rows twice)."""
    per_expert = pairs / min(n_experts, pairs)
    if per_expert <= 8:  # 8-row tiles throughout (a row's sums the same alone and batched); the rest by a sweep
        return MoeConfig(8, 64, 64, 4, 3) if pairs <= 16 else MoeConfig(8, 64, 128, 2, 5)
    if per_expert <= 32:
        return MoeConfig(16 if per_expert <= 16 else 32, 64, 64, 4, 3)
    return MoeConfig(64, 64, 128, 8, 3)


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    M,
    E,
    stride_lm,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_E)
    slot = tl.arange(0, BLOCK_K)
    row = tl.minimum(r, M - 1)  # rows past M repeat the last (not stored)
    logits = tl.load(logits_ptr + row[:, None] * stride_lm + e[None, :], mask=(e < E)[None, :], other=float("-inf"))
    logits = logits.to(tl.float32)
    top = tl.max(logits, 1)
    values = tl.full([BLOCK_R, BLOCK_K], float("-inf"), tl.float32)
    ids = tl.zeros([BLOCK_R, BLOCK_K], tl.int32)
    rest = logits
    for j in tl.static_range(TOP_K):  # the largest logit left, the lowest expert among equal ones
        v = tl.max(rest, 1)
        i = tl.minimum(tl.min(tl.where(rest == v[:, None], e[None, :], BLOCK_E), 1), E - 1)  # NaN rows: in range
        values = tl.where(slot[None, :] == j, v[:, None], values)
        ids = tl.where(slot[None, :] == j, i[:, None], ids)
        rest = tl.where(e[None, :] == i[:, None], float("-inf"), rest)
    p = tl.exp(values - top[:, None])  # slots past TOP_K: exp(-inf) = 0
    if RENORMALIZE:  # the softmax over the k chosen logits
        weights = p / tl.sum(p, 1)[:, None]
    else:  # the softmax over all E
        weights = p / tl.sum(tl.exp(logits - top[:, None]), 1)[:, None]
    out = r[:, None] * TOP_K + slot[None, :]
    out_mask = (r < M)[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe.py's route: (weights fp32 [M, k], expert ids int32 [M, k]), the experts by falling weight."""
    m, n_experts = logits.shape
    weights = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits.device)
    if m == 0:
        return weights, ids
    block_e = triton.next_power_of_2(n_experts)
    block_r = max(1, min(16, 2048 // block_e, triton.next_power_of_2(m)))
    _route_kernel[(triton.cdiv(m, block_r),)](
        logits,
        weights,
        ids,
        m,
        n_experts,
        logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
        **triton_util.pdl_launch(logits.device),
    )
    return weights, ids


@triton.jit
def _align_kernel(
    ids_ptr,
    pairs_ptr,
    tile_expert_ptr,
    P,
    max_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program e writes expert e's pairs, in order, at its run's first tile, pads the run's last tile with P (no
    pair), and marks its tiles as e's; program 0 also marks the tiles past every run -1."""
    after_previous(PDL)
    expert = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, P, CHUNK):
        mask = start + c < P
        counts += tl.histogram(tl.load(ids_ptr + start + c, mask=mask, other=0), BLOCK_E, mask=mask)
    e = tl.arange(0, BLOCK_E)
    tiles = tl.cdiv(counts, BLOCK_M)
    first_tile = tl.sum(tl.where(e < expert, tiles, 0))
    n_tiles = tl.sum(tl.where(e == expert, tiles, 0))
    count = tl.sum(tl.where(e == expert, counts, 0))
    run = pairs_ptr + first_tile * BLOCK_M
    seen = 0
    for start in range(0, P, CHUNK):
        p = start + c
        mine = (tl.load(ids_ptr + p, mask=p < P, other=-1) == expert).to(tl.int32)
        tl.store(run + seen + tl.cumsum(mine, 0) - 1, p, mask=mine == 1)
        seen += tl.sum(mine)
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(run + pad, P, mask=pad < n_tiles * BLOCK_M)
    for t in range(0, n_tiles, CHUNK):
        tl.store(tile_expert_ptr + first_tile + t + c, expert, mask=t + c < n_tiles)
    if expert == 0:
        for t in range(tl.sum(tiles), max_tiles, CHUNK):
            tl.store(tile_expert_ptr + t + c, -1, mask=t + c < max_tiles)


def align(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs int32 [max_tiles * block_m]: each tile's pair numbers, P where none; tile_expert int32 [max_tiles]:
    each tile's expert, -1 past the last), from the step's expert ids [M, k]; see the module docstring."""
    p = ids.numel()
    max_tiles = triton.cdiv(p, block_m) + min(n_experts, p)
    pairs = torch.empty(max_tiles * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=ids.device)
    _align_kernel[(n_experts,)](
        ids,
        pairs,
        tile_expert,
        p,
        max_tiles,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(n_experts),
        # a decode step's few pairs: one short chunk, but one element a thread of the 4 warps (older Tritons'
        # histogram counts an element once for each thread that holds a copy)
        CHUNK=min(1024, max(128, triton.next_power_of_2(p))),
        num_warps=4,
        **triton_util.pdl_launch(ids.device),
    )
    return pairs, tile_expert


@triton.jit
def _dense_dot(acc, x_ptr, x_rows, m_mask, w_ptr, rows, row_mask, K, BLOCK_K: tl.constexpr, DT, STAGES):
    """acc [BLOCK_N, BLOCK_M] plus W[rows] x^T for a dense weight [rows, K] (x as in qdot)."""
    kk = tl.arange(0, BLOCK_K)
    w_rows = rows.to(tl.int64) * K
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)
        x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(w.to(DT), tl.trans(x.to(DT)))
    return acc


@triton.jit
def _expert_dot(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    CODEBOOK: tl.constexpr,
    MASK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """W[rows] x^T [BLOCK_N, BLOCK_M] in fp32, for a quantized weight (QUANT, its GPU layout) or a dense one."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if QUANT:
        n_steps = tl.cdiv(K, GROUP * (8 // BITS))
        acc = qdot(
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
            0,
            n_steps,
            BITS,
            GROUP,
            HAS_OFFSET,
            CODEBOOK,
            MASK_N,
            EVEN_K,
            DT,
            ASM,
            STAGES,
        )
    else:
        acc = _dense_dot(acc, x_ptr, x_rows, m_mask, w_ptr, rows, row_mask, K, BLOCK_K, DT, STAGES)
    return acc


@triton.jit
def _rounded(acc, bias_ptr, features, mask, HAS_BIAS: tl.constexpr, dt: tl.constexpr):
    """A matmul's fp32 tile [BLOCK_M, BLOCK_N] rounded to dt, plus the bias rounded again, as the unfused reference
    computes them (in fp32 for what follows)."""
    y = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + features, mask=mask, other=0.0).to(dt).to(tl.float32)
        y = (y + bias[None, :]).to(dt).to(tl.float32)
    return y


@triton.jit
def _moe_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    w2_ptr,
    s2_ptr,
    o2_ptr,
    bias_ptr,
    y_ptr,
    out_ptr,
    route_w_ptr,
    count_ptr,
    pairs_ptr,
    tile_expert_ptr,
    P,
    N,
    K,
    n_pad,
    n_pad2,
    rows_per_expert,
    up_first,
    stride_xm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QUANT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    CODEBOOK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    DT: tl.constexpr,
    ASM: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One tile of pairs (one expert) times BLOCK_N output features. GATED (gate_up): x has a row per token; the
    expert's gate rows are rows e * rows_per_expert + f of w, its up rows e * rows_per_expert + up_first + f of w2
    (the same tensors for a stacked gate_up), and y [P, N] gets act(gate) * up. Else (down): x has a row per pair;
    y [P, N] takes each pair's rounded result, and the last pair of a row to finish this feature tile writes
    out[row] = sum over its k slots of weight * y."""
    wait_previous(PDL)
    pid_n = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tl.program_id(1))
    if expert >= 0:
        pairs = tl.load(pairs_ptr + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = pairs < P
        x_rows = (pairs // TOP_K if GATED else pairs).to(tl.int64) * stride_xm
        f = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        f_mask = f < N
        rows = expert * rows_per_expert + f
        acc = _expert_dot(
            x_ptr,
            x_rows,
            m_mask,
            w_ptr,
            s_ptr,
            o_ptr,
            rows,
            f_mask,
            n_pad,
            K,
            BLOCK_M,
            BLOCK_N,
            QUANT,
            BITS,
            GROUP,
            HAS_OFFSET,
            CODEBOOK,
            not EVEN_N,
            EVEN_K,
            BLOCK_K,
            DT,
            ASM,
            STAGES,
        )
        if GATED:
            acc_up = _expert_dot(
                x_ptr,
                x_rows,
                m_mask,
                w2_ptr,
                s2_ptr,
                o2_ptr,
                rows + up_first,
                f_mask,
                n_pad2,
                K,
                BLOCK_M,
                BLOCK_N,
                QUANT,
                BITS,
                GROUP,
                HAS_OFFSET,
                CODEBOOK,
                not EVEN_N,
                EVEN_K,
                BLOCK_K,
                DT,
                ASM,
                STAGES,
            )
        launch_next(PDL)  # only now: see triton_util.launch_next
        dt = y_ptr.dtype.element_ty
        mask = m_mask[:, None] & f_mask[None, :]
        y_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * N + f[None, :]
        if GATED:  # the biases [E, 2N]: the expert's gate bias, then its up bias
            gate = _rounded(tl.trans(acc), bias_ptr + expert * 2 * N, f, f_mask, HAS_BIAS, dt)
            up = _rounded(tl.trans(acc_up), bias_ptr + expert * 2 * N + N, f, f_mask, HAS_BIAS, dt)
            tl.store(y_ptrs, gated(gate, up, ACTIVATION).to(dt), mask=mask)
        else:
            tl.store(y_ptrs, _rounded(tl.trans(acc), bias_ptr + expert * N, f, f_mask, HAS_BIAS, dt).to(dt), mask=mask)
            _sum_slots(y_ptr, out_ptr, route_w_ptr, count_ptr, pairs, m_mask, f, f_mask, pid_n, N, TOP_K)


@triton.jit
def _sum_slots(y_ptr, out_ptr, route_w_ptr, count_ptr, pairs, m_mask, f, f_mask, pid_n, N, TOP_K: tl.constexpr):
    """After a tile's y is stored: each row's arrival at its counter for this feature tile; the rows whose k-th
    pair this was get out = sum_j w_j y_j over their slots in order (y of other programs: loads that bypass L1).
    Every thread reads the atomic's old values: Triton broadcasts a tensor atomic's results from 3.5 on
    (triton-lang/triton#7460; before, threads holding a copy of an element got 0)."""
    row = pairs // TOP_K
    counters = count_ptr + row * tl.num_programs(0) + pid_n
    tl.debug_barrier()  # every thread's y is stored before the counters' release
    last = m_mask & (tl.atomic_add(counters, 1, mask=m_mask, sem="acq_rel") == TOP_K - 1)
    tl.debug_barrier()
    if tl.sum(last.to(tl.int32)) > 0:
        mask = last[:, None] & f_mask[None, :]
        total = tl.zeros([pairs.shape[0], f.shape[0]], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            p = row * TOP_K + j
            y = tl.load(y_ptr + p.to(tl.int64)[:, None] * N + f[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            total += tl.load(route_w_ptr + p, mask=last, other=0.0)[:, None] * y.to(tl.float32)
        out = out_ptr + row.to(tl.int64)[:, None] * N + f[None, :]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counters, 0, mask=last)  # ready for the next launch


def _weight_args(w: Weight) -> tuple[list[torch.Tensor], dict]:
    """A weight's pointers (bytes, scales, offsets; a dense tensor three times) and its format's constexprs."""
    if isinstance(w, QuantWeight):
        layout = gpu_layout(w)
        offsets = layout.scales if layout.offsets is None else layout.offsets
        fmt = {
            "QUANT": True,
            "BITS": w.bits,
            "GROUP": w.group_size,
            "HAS_OFFSET": w.offsets is not None,
            "CODEBOOK": w.codebook,
        }
        return [layout.values, layout.scales, offsets], fmt
    w = w.contiguous()
    return [w, w, w], {"QUANT": False, "BITS": None, "GROUP": None, "HAS_OFFSET": False, "CODEBOOK": None}


def _format(w: Weight) -> tuple:
    if isinstance(w, QuantWeight):
        return w.bits, w.group_size, w.offsets is None, w.codebook, w.scales.dtype, w.perm is None
    return (w.dtype,)


def moe_triton(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts, config: MoeConfig | None = None
) -> torch.Tensor:
    """kernels/moe.py's moe: x [M, H] (fp16 or bf16) -> [M, H]."""
    m, hidden = x.shape
    top_k, n_experts = ids.shape[1], experts.n_experts
    inter = experts.intermediate_size
    if len({_format(w) for w in experts.gate_up}) > 1:
        raise ValueError("the experts' gate and up parts must share one format")
    if any(isinstance(w, QuantWeight) and w.perm is not None for w in [*experts.gate_up, experts.down]):
        raise ValueError("experts with an input permutation (act-order) are not supported")
    out = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or pick_config(m * top_k, n_experts)
    step = _Step(
        *align(ids.to(torch.int32).contiguous(), n_experts, cfg.block_m),
        weights.to(torch.float32).contiguous(),
        out,
        triton_util.split_counters(x.device, m * triton.cdiv(hidden, cfg.block_n_down), "moe"),
        cfg,
    )
    # gate_up: h [P, I]; a stacked gate_up holds expert e's gate rows then its up rows, split parts hold one each
    stacked = len(experts.gate_up) == 1
    h = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)
    rows = (2 * inter, inter) if stacked else (inter, 0)
    _grouped_matmul(step, x.contiguous(), experts.gate_up, experts.gate_up_bias, h, rows, experts.activation)
    # down: each pair's y [P, H], then each row's weighted sum over its slots into out
    y = torch.empty(m * top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_matmul(step, h, [experts.down], experts.down_bias, y, (hidden, 0), None)
    return out


@dataclass
class _Step:
    """What both grouped launches of a step share."""

    pairs: torch.Tensor  # align's
    tile_expert: torch.Tensor  # align's
    route_w: torch.Tensor  # fp32 [M, k]
    out: torch.Tensor  # [M, H]
    counters: torch.Tensor  # the down launch's, per row and feature tile
    config: MoeConfig


def _grouped_matmul(
    step: _Step,
    x: torch.Tensor,
    parts: list[Weight],
    bias: torch.Tensor | None,
    y: torch.Tensor,
    rows: tuple[int, int],
    activation: str | None,
) -> None:
    """One _moe_kernel launch: gate_up (an activation, parts: one stacked weight or gate and up) or down. rows:
    the weight rows per expert, and the offset of an expert's up rows from its gate rows."""
    cfg = step.config
    gated = activation is not None
    block_n = cfg.block_n_gate_up if gated else cfg.block_n_down
    n, k = y.shape[1], x.shape[1]
    (w, s, o), fmt = _weight_args(parts[0])
    (w2, s2, o2), _ = _weight_args(parts[-1])
    _moe_kernel[(triton.cdiv(n, block_n), step.tile_expert.numel())](
        x,
        w,
        s,
        o,
        w2,
        s2,
        o2,
        y if bias is None else bias,
        y,
        step.out,
        step.route_w,
        step.counters,
        step.pairs,
        step.tile_expert,
        y.shape[0],
        n,
        k,
        w.shape[-2],
        w2.shape[-2],
        *rows,
        x.stride(0),
        TOP_K=step.route_w.shape[1],
        GATED=gated,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=block_n,
        BLOCK_K=DENSE_BLOCK_K,
        EVEN_N=n % block_n == 0,
        EVEN_K=k % _step_k(parts[0]) == 0,
        DT=triton_util.arith_dtype(x.dtype),
        ASM=use_asm(),
        STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **fmt,
        **triton_util.pdl_launch(x.device),
    )


def _step_k(w: Weight) -> int:
    """K per step of w's loop."""
    return w.group_size * 8 // w.bits if isinstance(w, QuantWeight) else DENSE_BLOCK_K
