"""One request as the scheduler sees it: its tokens, its cache blocks, and its progress."""

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.block_manager import BlockTable
from llamaterm.engine.serving.grammar import GrammarMatcher
from llamaterm.engine.serving.speculation import Speculation

# the most tokens of a run its grammar forces that a sequence takes in one step (GrammarMatcher.fast_forward)
FORCED_MOST = 16


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
    seed: int = 0  # 64 bits: the request's seed, or a random one (kernels/sampling.py keys its draws on it)
    sampler_slot: int | None = None  # its row of the sampler's tables, from first admission to finish
    grammar: GrammarMatcher | None = None  # what its reply must match (params.grammar), advanced token by token
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_pending: int = 0  # token_ids still PENDING (sampled by a step in flight: model_runner.py)
    # tokens its grammar forced (GrammarMatcher.fast_forward), placed after a PENDING one and handed out with it
    num_forced: int = 0
    # drafts the step in flight verifies: the token_ids just before its PENDING one (engine/serving/speculation.py)
    num_drafts: int = 0
    speculation: Speculation | None = None  # None: it never drafts (off, penalties, a grammar)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    token_times: deque = field(default_factory=lambda: deque(maxlen=32))  # for the sliding-window rate

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known(self) -> int:
        """Tokens on the host and final: before the first pending one, and before any drafts."""
        return len(self.token_ids) - self.num_pending - self.num_drafts - self.num_forced

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
