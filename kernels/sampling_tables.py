"""What both samplers read (kernels/sampling.py, the torch reference, and kernels/sampling_triton.py): the per-slot
tables on the device, their columns, and the counter-based generator's constants (SplitMix64's)."""

from dataclasses import dataclass, fields

import torch

# columns of SamplingTables.floats
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
# columns of SamplingTables.ints, and the bits of its FLAGS column
TOP_K, SEED, FLAGS = range(INT_COLUMNS := 3)
BIASED, CONSTRAINED = 1, 2  # the slot's bias row is added; its bitmask row says which tokens may be sampled


@dataclass
class SamplingTables:
    """Per-slot sampling state, on the device. A slot is a sequence's for its whole life (engine/serving/
    scheduler.py), so a batch that changes rewrites only the rows of the slots that changed hands."""

    floats: torch.Tensor  # [slots, 6] fp32: temperature (0 = greedy), top_p, min_p, repetition, presence, frequency
    ints: torch.Tensor  # [slots, 3] int64: top_k (0 = off), seed (a 64-bit pattern), flags (BIASED | CONSTRAINED)
    counts: torch.Tensor  # [slots, vocab] int32: how often each token was sampled
    in_prompt: torch.Tensor  # [slots, vocab] uint8: 1 where the token is in the prompt
    bias: torch.Tensor  # [slots, vocab] fp32: logit_bias, added before penalties (read only where BIASED)
    # [slots, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t may be sampled (llguidance's
    # layout), rewritten before each step that samples a CONSTRAINED slot (engine/serving/grammar.py)
    bitmask: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, vocab: int, device: torch.device) -> "SamplingTables":
        z = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)
        return cls(
            z(slots, 6, dtype=torch.float32),
            z(slots, INT_COLUMNS, dtype=torch.int64),
            z(slots, vocab, dtype=torch.int32),
            z(slots, vocab, dtype=torch.uint8),
            z(slots, vocab, dtype=torch.float32),
            z(slots, bitmask_words(vocab), dtype=torch.int32),
        )

    def copy(self, device: torch.device | str) -> "SamplingTables":
        """A copy on `device` (tests and benchmarks: the samplers count up the tokens they sample)."""
        return SamplingTables(*(getattr(self, f.name).to(device, copy=True) for f in fields(self)))


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


# the counter-based generator's: SplitMix64's increment and its finalizer's multipliers
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
