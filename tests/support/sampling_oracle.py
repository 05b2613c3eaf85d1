"""The row-by-row sampler the engine ran before the batched one (kernels/sampling.py), kept as its test oracle: each
row on its own in plain torch ops. The draw is the same exponential race (argmax of p / E, E ~ Exp(1)) over draws
given by the caller, so the batched sampler and this one can be handed the same random numbers."""

import torch

from llamaterm.engine.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, token_ids: list[int], generated: list[int], p: SamplingParams
) -> torch.Tensor:
    """Repetition over prompt and output (divide positive logits of seen tokens, multiply negative ones); presence
    and frequency over the output."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(token_ids)))
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1])[: logits.shape[-1]]
        counts = counts.to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Set to -inf every logit outside top-k, outside the top-p nucleus, or below min_p * max prob."""
    if 0 < top_k < logits.shape[-1]:
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


def sample_row(
    logits: torch.Tensor, p: SamplingParams, token_ids: list[int], generated: list[int], exponential: torch.Tensor
) -> int:
    """One row's token; exponential [vocab] holds its Exp(1) draws."""
    penalised = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
    row = apply_penalties(logits.clone(), token_ids, generated, p) if penalised else logits
    if p.greedy:
        return int(row.argmax())
    row = filter_logits((row - row.max()) / p.temperature, p.top_k, p.top_p, p.min_p)
    return int((row.softmax(-1) / exponential).argmax())
