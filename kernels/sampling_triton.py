"""The batched sampler on CUDA: one program per row, no sort of the vocabulary (kernels/sampling.py says what a
row keeps and how it draws; its torch reference is this kernel's oracle).

Pass 1 reads the row once: penalties (written back), the maximum and its index, the mean of the finite logits, and
whether a logit is NaN or +inf. A greedy row ends there. A row with top-k or top-p then bounds its kept set:
pass 2 counts its logits in BINS bins below the maximum, each (max - mean) / 64 wide so a peaked row and a flat
one both spread over them, and sums the softmax normaliser. The top bins that hold at most CAP tokens are the
candidates when they provably hold every token the row keeps: the whole top-k set, or every token above the min-p
threshold, or (without top-k) a mass of at least top_p, by a lower bound from the bins. Pass 3 gathers them; they
are sorted in registers and cut as the reference cuts them, and the race runs among them. A row the bins cannot
bound (a flat distribution whose nucleus passes CAP tokens) finds its thresholds by bisection over the row
instead, about 64 more passes; a row with neither top-k nor top-p races over the whole row at once.
"""

import torch
import triton
import triton.language as tl

from llamaterm.kernels import sampling as ref

_TEMPERATURE = tl.constexpr(ref.TEMPERATURE)
_TOP_P = tl.constexpr(ref.TOP_P)
_MIN_P = tl.constexpr(ref.MIN_P)
_REPETITION = tl.constexpr(ref.REPETITION)
_PRESENCE = tl.constexpr(ref.PRESENCE)
_FREQUENCY = tl.constexpr(ref.FREQUENCY)
_TOP_K = tl.constexpr(ref.TOP_K)
_SEED = tl.constexpr(ref.SEED)
_GOLDEN = tl.constexpr(ref.GOLDEN)
_MIX1 = tl.constexpr(ref.MIX1)
_MIX2 = tl.constexpr(ref.MIX2)
_SPREAD_BINS = tl.constexpr(64)  # bins from the maximum down to the mean
_LOW32 = tl.constexpr(0xFFFFFFFF)
_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _mix64(z):
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


@triton.jit
def _gumbel(key, token_ids):
    z = _mix64(key + (token_ids.to(tl.uint64) + 1) * _GOLDEN)
    u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _okey(y):
    """fp32 -> int32 in the same order (negative floats: their magnitude bits flipped)."""
    b = y.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _from_okey(k):
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _bin(x, m, width, BINS: tl.constexpr):
    return tl.minimum((m - x) / width, BINS - 1).to(tl.int32)


@triton.jit
def _tail(row_ptr, vocab, m, temperature, threshold, BLOCK: tl.constexpr):
    """Count and probability mass (unnormalised) of the tokens whose y has an ordered key >= threshold."""
    count = 0
    mass = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        y = (tl.load(row_ptr + offs, mask=mask, other=_NEG_INF) - m) / temperature
        sel = mask & (_okey(y) >= threshold)
        count += tl.sum(sel.to(tl.int32), 0)
        mass += tl.sum(tl.where(sel, tl.exp(y), 0.0), 0)
    return count, mass


@triton.jit
def _race_row(row_ptr, vocab, m, temperature, lowest, key, BLOCK: tl.constexpr):
    """The race over every token of the row with y >= lowest."""
    best = _NEG_INF
    winner = 0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        y = (tl.load(row_ptr + offs, mask=mask, other=_NEG_INF) - m) / temperature
        score = tl.where(mask & (y >= lowest), y + _gumbel(key, offs), _NEG_INF)
        block_best = tl.max(score, 0)
        winner = tl.where(block_best > best, start + tl.argmax(score, 0), winner)
        best = tl.maximum(best, block_best)
    return winner.to(tl.int64)


@triton.jit
def _bisect_row(row_ptr, vocab, m, temperature, top_k, top_p, z, t_m, key, BLOCK: tl.constexpr):
    """Thresholds by bisection over ordered keys, each step a pass over the row, then the race."""
    t_k = tl.full((), _NEG_INF, tl.float32)
    z_k = z
    if (top_k > 0) & (top_k < vocab):
        lo = _okey(t_k)  # count(key >= lo) >= k holds; count(key >= hi) >= k does not
        hi = 1
        for _ in range(32):
            mid = lo + ((hi - lo) >> 1)  # lo + hi could leave int32
            count, _ = _tail(row_ptr, vocab, m, temperature, mid, BLOCK)
            lo = tl.where(count >= top_k, mid, lo)
            hi = tl.where(count >= top_k, hi, mid)
        t_k = _from_okey(lo)
        _, z_k = _tail(row_ptr, vocab, m, temperature, lo, BLOCK)
    t_p = _NEG_INF
    if top_p < 1.0:
        lo = _okey(t_k) - 1  # the mass above lo reaches top_p; above hi it does not
        hi = 0
        for _ in range(32):
            mid = lo + ((hi - lo) >> 1)  # lo + hi could leave int32
            _, mass = _tail(row_ptr, vocab, m, temperature, mid + 1, BLOCK)
            lo = tl.where(mass >= top_p * z_k, mid, lo)
            hi = tl.where(mass >= top_p * z_k, hi, mid)
        t_p = _from_okey(hi)
    return _race_row(row_ptr, vocab, m, temperature, tl.maximum(tl.maximum(t_k, t_p), t_m), key, BLOCK)


@triton.jit
def _race_candidates(cand_ptr, n, use_k, top_k, has_p, top_p, z, t_m, key, CAP: tl.constexpr):
    """Sort the n gathered candidates (packed: ordered key, then the complement of the token id), cut them as the
    reference cuts the sorted row, and race."""
    j = tl.arange(0, CAP)
    valid = j < n
    packed = tl.sort(tl.load(cand_ptr + j, mask=valid, other=-(2**63)), descending=True)
    y = tl.where(valid, _from_okey((packed >> 32).to(tl.int32)), _NEG_INF)
    ids = _LOW32 - (packed & _LOW32)
    t_k = tl.where(use_k, tl.sum(tl.where(j == top_k - 1, y, 0.0), 0), _NEG_INF)
    probs = tl.where(y >= t_k, tl.exp(y), 0.0)
    z_k = tl.where(use_k, tl.sum(probs, 0), z)
    crossing = tl.minimum(tl.sum((tl.cumsum(probs, 0) < top_p * z_k).to(tl.int32), 0), n - 1)
    t_p = tl.where(has_p, tl.sum(tl.where(j == crossing, y, 0.0), 0), _NEG_INF)
    keep = valid & (y >= t_k) & (y >= t_p) & (y >= t_m)
    score = tl.where(keep, y + _gumbel(key, ids), _NEG_INF)
    return tl.sum(tl.where(j == tl.argmax(score, 0), ids, 0), 0)


@triton.jit
def _draw(
    row_ptr,
    vocab,
    m,
    mean,
    temperature,
    top_k,
    top_p,
    min_p,
    key,
    cand_ptr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    BINS: tl.constexpr,
):
    has_k = (top_k > 0) & (top_k < vocab)
    has_p = top_p < 1.0
    t_m = tl.log(min_p)  # -inf for min_p 0
    token = tl.zeros((), tl.int64)
    if has_k | has_p:
        width = tl.maximum((m - mean) / _SPREAD_BINS, 1e-30)
        hist = tl.zeros((BINS,), tl.int32)
        z = 0.0
        for start in range(0, vocab, BLOCK):  # pass 2
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab, other=_NEG_INF)
            z += tl.sum(tl.exp((x - m) / temperature), 0)
            hist += tl.histogram(_bin(x, m, width, BINS), BINS)  # padding lands in the last bin
        bins = tl.arange(0, BINS)
        cum = tl.cumsum(hist, 0)
        top = tl.max(tl.where(cum <= CAP, bins, -1), 0)  # the candidates: bins 0..top
        held = tl.max(tl.where(cum <= CAP, cum, 0), 0)
        # a candidate of bin b has x > m - (b + 1) * width; the last bin has no lower edge
        edge = tl.where(bins < BINS - 1, tl.exp(-(bins + 1).to(tl.float32) * width / temperature), 0.0)
        mass_floor = tl.sum(tl.where(bins <= top, hist.to(tl.float32) * edge, 0.0), 0) * (1 - 1e-5)
        cover_k = has_k & (held >= top_k)
        cover_m = (top == BINS - 1) | (-t_m * temperature / width <= top.to(tl.float32) + 0.9375)
        cover_p = has_p & ~has_k & (mass_floor >= top_p * z)
        # without the whole top-k set, top-p's normaliser is out of reach: min-p alone then cannot bound the cut
        if (top >= 0) & (cover_k | cover_p | (cover_m & (cover_k | ~has_k | ~has_p))):
            n = 0
            for start in range(0, vocab, BLOCK):  # pass 3
                offs = start + tl.arange(0, BLOCK)
                mask = offs < vocab
                x = tl.load(row_ptr + offs, mask=mask, other=_NEG_INF)
                take = mask & (_bin(x, m, width, BINS) <= top)
                packed = (_okey((x - m) / temperature).to(tl.int64) << 32) | (_LOW32 - offs.to(tl.int64))
                tl.store(cand_ptr + n + tl.cumsum(take.to(tl.int32), 0) - 1, packed, mask=take)
                n += tl.sum(take.to(tl.int32), 0)
            tl.debug_barrier()  # the gathered candidates, written by every thread, are read by others
            token = _race_candidates(cand_ptr, n, cover_k, top_k, has_p, top_p, z, t_m, key, CAP)
        else:
            token = _bisect_row(row_ptr, vocab, m, temperature, top_k, top_p, z, t_m, key, BLOCK)
    else:
        token = _race_row(row_ptr, vocab, m, temperature, t_m, key, BLOCK)
    return token


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    slots_ptr,
    positions_ptr,
    floats_ptr,
    ints_ptr,
    counts_ptr,
    in_prompt_ptr,
    cand_ptr,
    tokens_ptr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    BINS: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        f = floats_ptr + slot * 6
        temperature = tl.load(f + _TEMPERATURE)
        rep = tl.load(f + _REPETITION)
        presence = tl.load(f + _PRESENCE)
        frequency = tl.load(f + _FREQUENCY)
        penalised = (rep != 1.0) | (presence != 0.0) | (frequency != 0.0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        state = slot * vocab
        m = _NEG_INF
        best = 0
        total = 0.0
        finite = 0
        bad = 0
        for start in range(0, vocab, BLOCK):  # pass 1
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            x = tl.load(row_ptr + offs, mask=mask, other=_NEG_INF)
            if penalised:
                c = tl.load(counts_ptr + state + offs, mask=mask, other=0)
                seen = (tl.load(in_prompt_ptr + state + offs, mask=mask, other=0) != 0) | (c > 0)
                x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
                x = x - frequency * c.to(tl.float32) - presence * (c > 0).to(tl.float32)
                tl.store(row_ptr + offs, x, mask=mask)
            bad = tl.maximum(bad, tl.max(((x != x) | (x == float("inf"))).to(tl.int32), 0))
            is_finite = x > _NEG_INF
            total += tl.sum(tl.where(is_finite, x, 0.0), 0)
            finite += tl.sum(is_finite.to(tl.int32), 0)
            block_max = tl.max(x, 0)
            best = tl.where(block_max > m, start + tl.argmax(x, 0), best)
            m = tl.maximum(m, block_max)
        ok = (bad == 0) & (m > _NEG_INF)
        token = best.to(tl.int64)
        if ok & (temperature > 0):
            seed = tl.load(ints_ptr + slot * 2 + _SEED).to(tl.uint64, bitcast=True)
            position = tl.load(positions_ptr + row).to(tl.uint64, bitcast=True)
            key = _mix64(seed ^ _mix64(position))
            token = _draw(
                row_ptr,
                vocab,
                m,
                total / tl.maximum(finite, 1),
                temperature,
                tl.load(ints_ptr + slot * 2 + _TOP_K),
                tl.load(f + _TOP_P),
                tl.load(f + _MIN_P),
                key,
                cand_ptr + row.to(tl.int64) * CAP,
                BLOCK,
                CAP,
                BINS,
            )
        tl.store(tokens_ptr + row, tl.where(ok, token, -1))
        if ok & penalised:
            at = counts_ptr + state + token
            tl.store(at, tl.load(at) + 1)


def sample_triton(
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    tables: ref.SamplingTables,
    tokens: torch.Tensor | None = None,
    block: int = 4096,
    cap: int = 1024,
    bins: int = 256,
) -> torch.Tensor:
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    if tokens is None:
        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    candidates = torch.empty(n, cap, dtype=torch.int64, device=logits.device)
    if n:
        _sample_kernel[(n,)](
            logits,
            logits.stride(0),
            vocab,
            slots,
            positions,
            tables.floats,
            tables.ints,
            tables.counts,
            tables.in_prompt,
            candidates,
            tokens,
            BLOCK=block,
            CAP=cap,
            BINS=bins,
            num_warps=8,
        )
    return tokens
