"""The batched sampler on CUDA (kernels/sampling.py says what a row keeps and how it draws; its torch reference is
this kernel's oracle). Every row is split into chunks of CHUNK tokens, so a step of 8 rows still spreads over the
whole GPU, and nothing sorts the vocabulary. Three launches:

1. per chunk, one read: logit bias, grammar mask and penalties (written back), the chunk's maximum and its
   index, NaN or +inf;
2. per chunk, with the row's maximum: the chunk's softmax mass, its race winner among the tokens min-p keeps, and,
   for rows with top-k or top-p, its candidates: the tokens above tau, the chunk's (L+1)-th largest, at most L;
3. per row: greedy rows take the argmax; rows with neither top-k nor top-p the best of the chunks' winners; the
   others find their thresholds by bisection over the candidates, held in registers. Every token above a
   threshold t > max(tau) is a candidate, so when the cut lands there (the usual case: top-k <= L, or a nucleus
   of at most L tokens in each chunk) and top-p's normaliser, the top-k set's mass, is among them, the candidates
   decide it exactly and the race runs among them; so they do where they hold every finite token of the row (a
   grammar's mask leaves few). Otherwise (a flat row whose nucleus is larger, a top-k above L) the row bisects over
   its whole length instead: slower, the same tokens.
"""

import torch
import triton
import triton.language as tl

from llamaterm.kernels import sampling_tables as layout

CHUNK = 8192  # tokens of a row per program of the first two launches
L = 128  # candidates a chunk keeps: top-k up to L is decided among them

_TEMPERATURE = tl.constexpr(layout.TEMPERATURE)
_TOP_P = tl.constexpr(layout.TOP_P)
_MIN_P = tl.constexpr(layout.MIN_P)
_REPETITION = tl.constexpr(layout.REPETITION)
_PRESENCE = tl.constexpr(layout.PRESENCE)
_FREQUENCY = tl.constexpr(layout.FREQUENCY)
_TOP_K = tl.constexpr(layout.TOP_K)
_SEED = tl.constexpr(layout.SEED)
_FLAGS = tl.constexpr(layout.FLAGS)
_BIASED = tl.constexpr(layout.BIASED)
_CONSTRAINED = tl.constexpr(layout.CONSTRAINED)
_INTS = tl.constexpr(layout.INT_COLUMNS)
_GOLDEN = tl.constexpr(layout.GOLDEN)
_MIX1 = tl.constexpr(layout.MIX1)
_MIX2 = tl.constexpr(layout.MIX2)
_LOW32 = tl.constexpr(0xFFFFFFFF)
_NEG_INF = tl.constexpr(float("-inf"))
_NO_KEY = tl.constexpr(-(2**31))  # below every float's ordered key: an empty candidate slot, or no tau


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
def _row_key(ints_ptr, positions_ptr, slot, row):
    seed = tl.load(ints_ptr + slot * _INTS + _SEED).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row).to(tl.uint64, bitcast=True)
    return _mix64(seed ^ _mix64(position))


@triton.jit
def _row_max(cmax_ptr, carg_ptr, cbad_ptr, base, n_chunks, PB: tl.constexpr):
    """The row's maximum, the first index holding it, and whether a chunk saw NaN or +inf."""
    c = tl.arange(0, PB)
    ok = c < n_chunks
    maxima = tl.load(cmax_ptr + base + c, mask=ok, other=_NEG_INF)
    m = tl.max(maxima, 0)
    first = tl.min(tl.where(ok & (maxima == m), tl.load(carg_ptr + base + c, mask=ok, other=0), 2**31 - 1), 0)
    bad = tl.max(tl.load(cbad_ptr + base + c, mask=ok, other=0), 0)
    return m, first, bad


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,
    stride,
    vocab,
    slots_ptr,
    floats_ptr,
    ints_ptr,
    counts_ptr,
    in_prompt_ptr,
    bias_ptr,
    bitmask_ptr,
    n_words,
    cmax_ptr,
    carg_ptr,
    cbad_ptr,
    n_chunks,
    CHUNK: tl.constexpr,
):
    row, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        f = floats_ptr + slot * 6
        rep = tl.load(f + _REPETITION)
        presence = tl.load(f + _PRESENCE)
        frequency = tl.load(f + _FREQUENCY)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=_NEG_INF)
        flags = tl.load(ints_ptr + slot * _INTS + _FLAGS)
        state = slot * vocab
        if (flags & _BIASED) != 0:
            x += tl.load(bias_ptr + state + offs, mask=mask, other=0.0)
        if (flags & _CONSTRAINED) != 0:
            words = tl.load(bitmask_ptr + slot * n_words + offs // 32, mask=mask, other=0)
            x = tl.where(((words >> (offs % 32)) & 1) != 0, x, _NEG_INF)
        penalised = (rep != 1.0) | (presence != 0.0) | (frequency != 0.0)
        if penalised:
            n = tl.load(counts_ptr + state + offs, mask=mask, other=0)
            seen = (tl.load(in_prompt_ptr + state + offs, mask=mask, other=0) != 0) | (n > 0)
            x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
            x = x - frequency * n.to(tl.float32) - presence * (n > 0).to(tl.float32)
        if penalised | (flags != 0):
            tl.store(row_ptr + offs, x, mask=mask)
        at = row * n_chunks + c
        tl.store(cmax_ptr + at, tl.max(x, 0))
        tl.store(carg_ptr + at, c * CHUNK + tl.argmax(x, 0))
        tl.store(cbad_ptr + at, tl.max(((x != x) | (x == float("inf"))).to(tl.int32), 0))


@triton.jit
def _chunk_candidates_kernel(
    logits_ptr,
    stride,
    vocab,
    slots_ptr,
    positions_ptr,
    floats_ptr,
    ints_ptr,
    cmax_ptr,
    carg_ptr,
    cbad_ptr,
    n_chunks,
    mass_ptr,
    best_ptr,
    best_id_ptr,
    tau_ptr,
    n_cand_ptr,
    cand_ptr,
    CHUNK: tl.constexpr,
    L: tl.constexpr,
    PB: tl.constexpr,
):
    row, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        f = floats_ptr + slot * 6
        temperature = tl.load(f + _TEMPERATURE)
        m, _, bad = _row_max(cmax_ptr, carg_ptr, cbad_ptr, row * n_chunks, n_chunks, PB)
        if (temperature > 0) & (bad == 0) & (m > _NEG_INF):
            at = row * n_chunks + c
            offs = c * CHUNK + tl.arange(0, CHUNK)
            mask = offs < vocab
            y = (tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=_NEG_INF) - m) / temperature
            tl.store(mass_ptr + at, tl.sum(tl.exp(y), 0))
            score = tl.where(
                mask & (y >= tl.log(tl.load(f + _MIN_P))),
                y + _gumbel(_row_key(ints_ptr, positions_ptr, slot, row), offs),
                _NEG_INF,
            )
            tl.store(best_ptr + at, tl.max(score, 0))
            tl.store(best_id_ptr + at, c * CHUNK + tl.argmax(score, 0))
            top_k = tl.load(ints_ptr + slot * _INTS + _TOP_K)
            if ((top_k > 0) & (top_k < vocab)) | (tl.load(f + _TOP_P) < 1.0):
                keys = tl.where(mask, _okey(y), _NO_KEY)
                tau = _NO_KEY
                if tl.sum(mask.to(tl.int32), 0) > L:  # tau: the largest key that L + 1 tokens reach
                    lo = _okey(tl.full((), _NEG_INF, tl.float32))
                    hi = 1
                    for _ in range(32):
                        mid = lo + ((hi - lo) >> 1)  # lo + hi could leave int32
                        enough = tl.sum((keys >= mid).to(tl.int32), 0) > L
                        lo = tl.where(enough, mid, lo)
                        hi = tl.where(enough, hi, mid)
                    tau = lo
                take = keys > tau
                packed = (keys.to(tl.int64) << 32) | (_LOW32 - offs.to(tl.int64))
                tl.store(cand_ptr + at * L + tl.cumsum(take.to(tl.int32), 0) - 1, packed, mask=take)
                tl.store(tau_ptr + at, tau)
                tl.store(n_cand_ptr + at, tl.sum(take.to(tl.int32), 0))


@triton.jit
def _tail(row_ptr, vocab, m, temperature, keys, e, threshold, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Count and probability mass (unnormalised) of the tokens whose y has an ordered key >= threshold: among the
    candidates (keys, e), or over the whole row."""
    if FROM_ROW:
        count = 0
        mass = 0.0
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab
            y = (tl.load(row_ptr + offs, mask=mask, other=_NEG_INF) - m) / temperature
            sel = mask & (_okey(y) >= threshold)
            count += tl.sum(sel.to(tl.int32), 0)
            mass += tl.sum(tl.where(sel, tl.exp(y), 0.0), 0)
    else:
        sel = keys >= threshold
        count = tl.sum(sel.to(tl.int32), 0)
        mass = tl.sum(tl.where(sel, e, 0.0), 0)
    return count, mass


@triton.jit
def _thresholds(row_ptr, vocab, m, temperature, keys, e, top_k, top_p, z, FROM_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Ordered keys of the top-k and top-p thresholds (kernels/sampling.py), by bisection."""
    lowest = _okey(tl.full((), _NEG_INF, tl.float32))
    key_k = lowest
    z_k = z
    if (top_k > 0) & (top_k < vocab):
        lo = lowest  # count(key >= lo) >= k holds; count(key >= hi) >= k does not
        hi = 1
        for _ in range(32):
            mid = lo + ((hi - lo) >> 1)  # lo + hi could leave int32
            count, _ = _tail(row_ptr, vocab, m, temperature, keys, e, mid, FROM_ROW, BLOCK)
            lo = tl.where(count >= top_k, mid, lo)
            hi = tl.where(count >= top_k, hi, mid)
        key_k = lo
        _, z_k = _tail(row_ptr, vocab, m, temperature, keys, e, lo, FROM_ROW, BLOCK)
    key_p = lowest
    if top_p < 1.0:
        lo = key_k - 1  # the mass above lo reaches top_p; above hi it does not
        hi = 0
        for _ in range(32):
            mid = lo + ((hi - lo) >> 1)
            _, mass = _tail(row_ptr, vocab, m, temperature, keys, e, mid + 1, FROM_ROW, BLOCK)
            lo = tl.where(mass >= top_p * z_k, mid, lo)
            hi = tl.where(mass >= top_p * z_k, hi, mid)
        key_p = hi
    return key_k, key_p


@triton.jit
def _race_row(row_ptr, vocab, m, temperature, lowest, key, BLOCK: tl.constexpr):
    """The race over every token of the row whose y has an ordered key >= lowest."""
    best = _NEG_INF
    winner = tl.zeros((), tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        y = (tl.load(row_ptr + offs, mask=mask, other=_NEG_INF) - m) / temperature
        score = tl.where(mask & (_okey(y) >= lowest), y + _gumbel(key, offs), _NEG_INF)
        block_best = tl.max(score, 0)
        winner = tl.where(block_best > best, start + tl.argmax(score, 0), winner)
        best = tl.maximum(best, block_best)
    return winner.to(tl.int64)


@triton.jit
def _row_token_kernel(
    logits_ptr,
    stride,
    vocab,
    slots_ptr,
    positions_ptr,
    floats_ptr,
    ints_ptr,
    counts_ptr,
    cmax_ptr,
    carg_ptr,
    cbad_ptr,
    n_chunks,
    mass_ptr,
    best_ptr,
    best_id_ptr,
    tau_ptr,
    n_cand_ptr,
    cand_ptr,
    tokens_ptr,
    L: tl.constexpr,
    PB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        f = floats_ptr + slot * 6
        temperature = tl.load(f + _TEMPERATURE)
        base = row * n_chunks
        m, token, bad = _row_max(cmax_ptr, carg_ptr, cbad_ptr, base, n_chunks, PB)
        token = token.to(tl.int64)
        ok = (bad == 0) & (m > _NEG_INF)
        if ok & (temperature > 0):
            c = tl.arange(0, PB)
            chunks = c < n_chunks
            top_k = tl.load(ints_ptr + slot * _INTS + _TOP_K)
            top_p = tl.load(f + _TOP_P)
            if ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0):  # thresholds to find
                z = tl.sum(tl.load(mass_ptr + base + c, mask=chunks, other=0.0), 0)
                tau = tl.max(tl.load(tau_ptr + base + c, mask=chunks, other=_NO_KEY), 0)
                j = tl.arange(0, L)
                n = tl.load(n_cand_ptr + base + c, mask=chunks, other=0)
                held = chunks[:, None] & (j[None, :] < n[:, None])
                packed = tl.load(cand_ptr + (base + c)[:, None] * L + j[None, :], mask=held, other=0)
                packed = tl.reshape(tl.where(held, packed, _NO_KEY * (2**32)), [PB * L])
                keys = (packed >> 32).to(tl.int32)
                ids = _LOW32 - (packed & _LOW32)
                e = tl.where(keys > _NO_KEY, tl.exp(_from_okey(keys)), 0.0)
                row_ptr = logits_ptr + row.to(tl.int64) * stride
                key_k, key_p = _thresholds(row_ptr, vocab, m, temperature, keys, e, top_k, top_p, z, False, BLOCK)
                lowest = tl.maximum(tl.maximum(key_k, key_p), _okey(tl.log(tl.load(f + _MIN_P))))
                key = _row_key(ints_ptr, positions_ptr, slot, row)
                # every token the row keeps is a candidate, and top-p's normaliser (the top-k set's mass) was among
                # them if it was needed; or every finite token is one (a grammar's mask leaves fewer than L + 1 in
                # each chunk, often fewer than top-k: the candidates are then the whole row)
                has_k = (top_k > 0) & (top_k < vocab)
                whole = tau <= _okey(tl.full((), _NEG_INF, tl.float32))
                if whole | ((lowest > tau) & ((key_k > tau) | ~has_k | (top_p >= 1.0))):
                    y = _from_okey(keys)
                    score = tl.where(keys >= lowest, y + _gumbel(key, ids), _NEG_INF)
                    token = tl.sum(tl.where(tl.arange(0, PB * L) == tl.argmax(score, 0), ids, 0), 0)
                else:
                    key_k, key_p = _thresholds(row_ptr, vocab, m, temperature, keys, e, top_k, top_p, z, True, BLOCK)
                    lowest = tl.maximum(tl.maximum(key_k, key_p), _okey(tl.log(tl.load(f + _MIN_P))))
                    token = _race_row(row_ptr, vocab, m, temperature, lowest, key, BLOCK)
            else:
                best = tl.load(best_ptr + base + c, mask=chunks, other=_NEG_INF)
                winners = tl.load(best_id_ptr + base + c, mask=chunks, other=0)
                token = tl.sum(tl.where(c == tl.argmax(best, 0), winners, 0), 0).to(tl.int64)
        tl.store(tokens_ptr + row, tl.where(ok, token, -1))
        rep, presence, frequency = tl.load(f + _REPETITION), tl.load(f + _PRESENCE), tl.load(f + _FREQUENCY)
        if ok & ((rep != 1.0) | (presence != 0.0) | (frequency != 0.0)):
            at = counts_ptr + slot * vocab + token
            tl.store(at, tl.load(at) + 1)


def sample_triton(
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    tables: layout.SamplingTables,
    tokens: torch.Tensor | None = None,
    chunk: int = CHUNK,
    candidates: int = L,
    block: int = 4096,
) -> torch.Tensor:
    """`chunk` and `candidates` (powers of two) set the launches' sizes; `block` the whole-row passes'."""
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    dev = logits.device
    if tokens is None:
        tokens = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return tokens
    p = triton.cdiv(vocab, chunk)
    pb = triton.next_power_of_2(p)
    per_chunk = lambda dtype: torch.empty(n, p, dtype=dtype, device=dev)
    cmax, carg, cbad = per_chunk(torch.float32), per_chunk(torch.int32), per_chunk(torch.int32)
    mass, best, best_id = per_chunk(torch.float32), per_chunk(torch.float32), per_chunk(torch.int32)
    tau, n_cand = per_chunk(torch.int32), per_chunk(torch.int32)
    cand = torch.empty(n, p, candidates, dtype=torch.int64, device=dev)
    t = tables
    warps = 16 if chunk >= 8192 else 8
    # the kernels' arguments in the groups they share: the rows; each row's position and its slot's values; each
    # chunk's maximum; the chunks' candidates
    rows, per_row = (logits, logits.stride(0), vocab, slots), (positions, t.floats, t.ints)
    maxima, found = (cmax, carg, cbad, p), (mass, best, best_id, tau, n_cand, cand)
    state = (t.floats, t.ints, t.counts, t.in_prompt, t.bias, t.bitmask, t.bitmask.shape[1])
    _chunk_stats_kernel[(n, p)](*rows, *state, *maxima, CHUNK=chunk, num_warps=warps)
    _chunk_candidates_kernel[(n, p)](
        *rows, *per_row, *maxima, *found, CHUNK=chunk, L=candidates, PB=pb, num_warps=warps
    )
    _row_token_kernel[(n,)](
        *rows, *per_row, t.counts, *maxima, *found, tokens, L=candidates, PB=pb, BLOCK=block, num_warps=16
    )
    return tokens
