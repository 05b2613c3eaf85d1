"""Next-token selection for a whole step at once: every row has its own penalties, temperature, top-k, top-p,
min-p and seed, read from per-slot tables on the device, so a step samples all its rows in one pass and a batch
change rewrites only the slots that joined.

What a row keeps, for y = (x - max x) / temperature (x: the penalised logits):
- top-k: y >= the k-th largest y (ties with it stay), when 1 <= k < vocab;
- top-p: among those, y >= the value at which the descending cumulative probability first reaches top_p (so the
  token that crosses top_p stays, and the most probable token always does);
- min-p: y >= log(min_p), i.e. p >= min_p * p_max.
Every rule keeps all the tokens at or above one threshold, so the kept set is {y >= the largest of the three}.

The draw is an exponential race (the Gumbel-max trick): the kept token with the largest y + g wins, g = -log(-log u)
with u from a counter-based generator keyed by (seed, position, token id). A token's noise depends on nothing else,
so a seeded request samples the same tokens alone and in any batch, and rows need no generator state.

Before all of that, a slot's logit_bias row is added (BIASED) and the tokens its grammar's bitmask rules out are
set to -inf (CONSTRAINED). Penalties (repetition over prompt and output, presence and frequency over the output)
read per-slot token counts kept on the device: a slot's counts are set when its sequence joins and counted up here
as each token is sampled.

A row whose logits hold NaN or +inf, or are all -inf, samples -1: its request ends with an error, the others go on.
This file holds the torch reference (the CPU path and the oracle of the Triton kernel); kernels/sampling_triton.py
is the CUDA path; kernels/sampling_tables.py the tables and constants both read.
"""

import torch

from llamaterm.kernels.dispatch import use_triton
from llamaterm.kernels.sampling_tables import (
    BIASED,
    CONSTRAINED,
    FLAGS,
    FREQUENCY,
    GOLDEN,
    MIN_P,
    MIX1,
    MIX2,
    PRESENCE,
    REPETITION,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingTables,
)


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    tables: SamplingTables,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [S, vocab] fp32 (penalised in place), slots [S] (-1: a padding row, left alone), positions [S]: the
    index in its sequence of the token each row samples. Returns token ids [S] int64 (-1: the row's logits were
    not finite), written into `tokens` when given. Nothing here waits for the device."""
    if use_triton(logits):
        from llamaterm.kernels.sampling_triton import sample_triton

        return sample_triton(logits, slots, positions, tables, tokens)
    out = sample_ref(logits, slots, positions, tables)
    return out if tokens is None else tokens.copy_(out)


# ---- the counter-based generator: SplitMix64's finalizer, on int64 lanes that wrap as uint64 would ----


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes read as uint64."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One key per row from its seed and the position it samples."""
    return mix64(seeds ^ mix64(positions))


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise g = -log(-log u) for each (key, token id) pair; u has 23 random bits, in (0, 1)."""
    z = mix64(keys + (token_ids + 1) * _signed(GOLDEN))
    u = (_shr(z, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


# ---- the reference ----


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] bool from bitmask rows [R, words]: bit t % 32 of word t // 32 (an arithmetic shift keeps bit 0
    right for bit 31 too)."""
    t = torch.arange(vocab, device=bitmask.device)
    return ((bitmask[:, t // 32] >> (t % 32)) & 1) != 0


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """x [R, vocab] logits of rows with penalties, their slots' counts and prompt marks, f [R, 6] their floats."""
    seen = (in_prompt != 0) | (counts > 0)
    rep = f[:, REPETITION, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    c = counts.to(x.dtype)
    return x - f[:, FREQUENCY, None] * c - f[:, PRESENCE, None] * (c > 0).to(x.dtype)


def thresholds(y: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The smallest y each row keeps (see the module's docstring); y [R, vocab], the rest [R]."""
    n, vocab = y.shape
    lowest = torch.full((n,), float("-inf"), dtype=y.dtype)
    t_k = lowest.clone()
    has_k = (top_k > 0) & (top_k < vocab)
    if has_k.any():
        kth = torch.topk(y[has_k], int(top_k[has_k].max())).values
        t_k[has_k] = kth.gather(1, top_k[has_k, None] - 1)[:, 0]
    t_p = lowest.clone()
    has_p = top_p < 1
    if has_p.any():
        ys = y[has_p].sort(dim=-1, descending=True).values
        probs = torch.where(ys >= t_k[has_p, None], ys.exp(), 0.0)
        cum = probs.cumsum(-1)
        crossing = (cum < top_p[has_p, None] * cum[:, -1:]).sum(-1).clamp(max=vocab - 1)
        t_p[has_p] = ys.gather(1, crossing[:, None])[:, 0]
    return torch.maximum(torch.maximum(t_k, t_p), min_p.log())  # log(0) = -inf: no min-p cut


def sample_ref(
    logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, tables: SamplingTables
) -> torch.Tensor:
    tokens = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    rows = torch.nonzero(slots >= 0)[:, 0]
    if rows.numel() == 0:
        return tokens
    s = slots[rows]
    f, ints = tables.floats[s], tables.ints[s]
    x = logits[rows]
    biased, constrained = (ints[:, FLAGS] & BIASED) != 0, (ints[:, FLAGS] & CONSTRAINED) != 0
    x[biased] += tables.bias[s[biased]]
    x[constrained] = torch.where(allowed(tables.bitmask[s[constrained]], x.shape[1]), x[constrained], float("-inf"))
    penalised = (f[:, REPETITION] != 1) | (f[:, PRESENCE] != 0) | (f[:, FREQUENCY] != 0)
    if penalised.any():
        ps = s[penalised]
        x[penalised] = apply_penalties(x[penalised], tables.counts[ps], tables.in_prompt[ps], f[penalised])
    if (biased | constrained | penalised).any():
        logits[rows] = x  # as the kernel does: the logits sampled from are left in place
    m, out = x.max(-1).values, x.argmax(-1)  # the first of tied maxima, as the kernel
    bad = x.isnan().any(-1) | (x == float("inf")).any(-1) | (m == float("-inf"))
    sampled = (f[:, TEMPERATURE] > 0) & ~bad
    if sampled.any():
        fs = f[sampled]
        # shifted so the best logit is 0 before dividing: a tiny temperature sends the others to -inf (greedy,
        # its limit) instead of every logit to +-inf
        y = (x[sampled] - m[sampled, None]) / fs[:, TEMPERATURE, None]
        keep = y >= thresholds(y, ints[sampled, TOP_K], fs[:, TOP_P], fs[:, MIN_P])[:, None]
        r, i = torch.nonzero(keep, as_tuple=True)
        keys = row_keys(ints[sampled, SEED], positions[rows][sampled])
        score = torch.full_like(y, float("-inf"))
        score[r, i] = y[r, i] + gumbel(keys[r], i)
        out[sampled] = score.argmax(-1)
    out[bad] = -1
    tokens[rows] = out
    counted = penalised & ~bad
    if counted.any():
        tables.counts[s[counted], out[counted]] += 1
    return tokens
