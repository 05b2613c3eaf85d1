"""One request as the scheduler sees it: its tokens, its cache blocks, and its progress."""

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.block_manager import BlockTableEntry

# A token sampled by a step still in flight: its value is on the device (the next step reads it there) and reaches
# token_ids when that step completes (engine/serving/engine.py). Only the last tokens of a sequence can be pending.
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # params.max_tokens clamped to the context
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    table: BlockTableEntry = field(default_factory=BlockTableEntry)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_pending: int = 0  # trailing token_ids still PENDING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    token_times: deque = field(default_factory=lambda: deque(maxlen=32))  # for the sliding-window rate

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def done_sampling(self) -> bool:
        """Every token it may generate is sampled (some may still be pending): no step needs it any more."""
        return self.num_generated >= self.max_tokens

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
