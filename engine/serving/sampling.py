"""Next-token selection for a batch in which every request has its own sampling params and seed.

Each row is computed on its own (penalties, temperature, top-k, top-p, min-p), so a request samples the same
tokens alone or in any batch. Sampling draws with the exponential race (argmax of p / E, E ~ Exp(1) from the
request's own generator), which picks token i with probability p_i.
"""

import torch

from llamaterm.engine.serving.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_generated:
        out = torch.tensor(seq.generated, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Set to -inf every logit outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p (the first one is always kept)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [S, vocab] fp32, one row per sequence -> token ids [S] (int64, on logits' device). Nothing here waits
    for the device (penalties aside, which copy the sequence's tokens to it), so the engine can schedule the next
    step while this one runs."""
    tokens = logits.argmax(-1)  # the greedy answer for every row; sampled rows are replaced below
    for i, seq in enumerate(seqs):
        p = seq.params
        penalised = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        if p.greedy and not penalised:
            continue
        row = apply_penalties(logits[i].clone(), seq) if penalised else logits[i]
        if p.greedy:
            tokens[i] = row.argmax()
            continue
        # shifted so the best logit is 0 before dividing: a tiny temperature sends the others to -inf (greedy,
        # its limit) instead of every logit to +-inf and the softmax to NaN (which sampled token 0)
        row = filter_logits((row - row.max()) / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = row.softmax(-1)
        race = torch.empty_like(probs).exponential_(generator=seq.generator)
        tokens[i] = (probs / race).argmax()
    return tokens


def needs_history(seq: Sequence) -> bool:
    """Penalties read the sequence's tokens on the host, so its previous token must have arrived there."""
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)
