"""Log-probabilities of sampled tokens, for the rows of a step whose request asked (SamplingParams.logprobs).

They are the model's own: log-softmax of the raw logits, before logit bias, a grammar's mask, penalties,
temperature and the filters, as OpenAI and vLLM report them. The sampler changes the logits in place, so the rows
are copied out between the forward pass and the sampler (cuda_graph.py's `between`), and the sampled token's
entry is gathered after it. Nothing here waits for the device: the results reach the host with the step's tokens.
"""

import torch

from llamaterm.engine.api import TokenLogprob


class StepLogprobs:
    def __init__(self, logits: torch.Tensor, rows: list[int], top: list[int]):
        """logits [step rows, vocab]; rows: the step rows that asked, top: how many alternatives each wants."""
        self.rows, self.top = rows, top
        self.index = torch.tensor(rows, device=logits.device)
        self.raw = logits.index_select(0, self.index).float()  # a copy, before the sampler changes the logits
        self.norm = torch.logsumexp(self.raw, -1, keepdim=True)
        self.top_values, self.top_ids = torch.topk(self.raw, max(top), -1)
        self.host: list[torch.Tensor] = []

    def gather(self, tokens: torch.Tensor) -> None:
        """Queued after the sampler: the sampled tokens' entries, and every result's copy to the host (pinned
        memory, so the copy does not wait; the step's token event, recorded after it, marks it done)."""
        sampled = tokens.index_select(0, self.index).clamp(min=0)[:, None]  # -1: not finite, its request ends
        chosen = (self.raw.gather(1, sampled) - self.norm)[:, 0]
        self.host = [t.to("cpu", non_blocking=True) for t in (chosen, self.top_values - self.norm, self.top_ids)]

    def read(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """By step row, once the step's tokens are on the host."""
        chosen, values, ids = (t.tolist() for t in self.host)
        out = {}
        for i, (row, k) in enumerate(zip(self.rows, self.top, strict=True)):
            top = tuple(zip(ids[i][:k], values[i][:k], strict=True))
            out[row] = TokenLogprob(tokens[row], chosen[i], top)
        return out
