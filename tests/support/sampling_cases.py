"""Inputs of the sampler tests and of its benchmark (tests/benchmarks/sampler_bench.py): rows of sampling params
written into the sampler's tables as the engine writes them, and logits shaped like a model's (peaked), plain
or flat."""

import random

import torch

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.sampling import as_int64
from llamaterm.kernels import sampling
from llamaterm.kernels.sampling import SamplingTables, gumbel, row_keys

VOCAB = 200


class Batch:
    """Rows with their params, prompts and generated tokens, written into sampler tables as the engine does."""

    def __init__(self, params: list[SamplingParams], seed: int, slots: int | None = None, vocab: int = VOCAB):
        rng = random.Random(seed)
        self.params, self.vocab = params, vocab
        self.prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in params]
        self.generated = [[rng.randrange(vocab) for _ in range(rng.randint(0, 200))] for _ in params]
        n = slots or len(params)
        self.slots = torch.tensor(rng.sample(range(n), len(params)))  # rows and slots in different orders
        self.positions = torch.tensor([len(a) + len(b) for a, b in zip(self.prompts, self.generated, strict=True)])
        self.tables = SamplingTables.allocate(n, vocab, torch.device("cpu"))
        for slot, p, prompt, gen in zip(self.slots.tolist(), params, self.prompts, self.generated, strict=True):
            self.tables.floats[slot] = torch.tensor(
                [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
            )
            self.tables.ints[slot, :2] = torch.tensor([p.top_k, as_int64(p.seed or 0)])
            self.tables.in_prompt[slot, prompt] = 1
            self.tables.counts[slot] = torch.bincount(torch.tensor(gen, dtype=torch.int64), minlength=vocab)
            for token, bias in p.logit_bias:
                self.tables.bias[slot, token] = bias
                self.tables.ints[slot, sampling.FLAGS] |= sampling.BIASED

    def allow_only(self, i: int, tokens: set[int]) -> None:
        """Row i may sample only `tokens`, as a grammar's bitmask says: bit t % 32 of word t // 32."""
        slot = int(self.slots[i])
        words = [0] * self.tables.bitmask.shape[1]
        for t in tokens:
            words[t // 32] |= 1 << (t % 32)
        self.tables.bitmask[slot] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words])
        self.tables.ints[slot, sampling.FLAGS] |= sampling.CONSTRAINED

    def tables_on(self, device) -> SamplingTables:
        """A copy: the samplers count up the tokens they sample."""
        return self.tables.copy(device)

    def exponential(self, i: int) -> torch.Tensor:
        """Row i's Exp(1) draws, from the generator the batched sampler keys on (seed, position, token id)."""
        key = row_keys(self.tables.ints[self.slots[i], sampling.SEED][None], self.positions[i][None])
        return torch.exp(-gumbel(key.expand(self.vocab), torch.arange(self.vocab)))


def logits_like(kind: str, rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "peaked":  # a model's row: a few strong candidates over a long tail
        return x * 2 + torch.where(torch.rand(rows, vocab, generator=g) < 0.03, 8.0, 0.0)
    return x * {"flat": 0.05, "plain": 1.0}[kind]
