"""What both samplers read (kernels/sampling.py, the torch reference, and kernels/sampling_triton.py): the per-slot
tables on the device, their columns, and the counter-based generator's constants (SplitMix64's)."""

from dataclasses import dataclass

import torch

# columns of SamplingTables.floats
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
# columns of SamplingTables.ints
TOP_K, SEED = range(2)


@dataclass
class SamplingTables:
    """Per-slot sampling state, on the device. A slot is a sequence's for its whole life (engine/serving/
    scheduler.py), so a batch that changes rewrites only the rows of the slots that changed hands."""

    floats: torch.Tensor  # [slots, 6] fp32: temperature (0 = greedy), top_p, min_p, repetition, presence, frequency
    ints: torch.Tensor  # [slots, 2] int64: top_k (0 = off), seed (a 64-bit pattern)
    counts: torch.Tensor  # [slots, vocab] int32: how often each token was sampled
    in_prompt: torch.Tensor  # [slots, vocab] uint8: 1 where the token is in the prompt

    @classmethod
    def allocate(cls, slots: int, vocab: int, device: torch.device) -> "SamplingTables":
        z = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)
        return cls(
            z(slots, 6, dtype=torch.float32),
            z(slots, 2, dtype=torch.int64),
            z(slots, vocab, dtype=torch.int32),
            z(slots, vocab, dtype=torch.uint8),
        )


# the counter-based generator's: SplitMix64's increment and its finalizer's multipliers
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
