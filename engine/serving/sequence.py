"""One request as the scheduler sees it: its tokens, its cache blocks, and its progress. The confirmed tokens (prompt,
then the reply's tokens on the host) are read-only outside (token_ids is typed so); the tail is apart, and changes
through propose, launch, force and settle (the model runner's) and drop:

    confirmed          drafts        in flight and forced
    [prompt|generated] [d1 d2 d3]    [PENDING f1 f2 PENDING f3]
"""

import enum
from collections.abc import Sequence as ReadOnly
from dataclasses import InitVar, dataclass, field

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.block_manager import BlockTable
from llamaterm.engine.serving.grammar import GrammarMatcher
from llamaterm.engine.serving.speculation import Speculation, accepted

# the most tokens of a run its grammar forces that a sequence takes in one step (GrammarMatcher.fast_forward)
FORCED_MOST = 16
# A token sampled by a step in flight: its value is on the device (the next step reads it there) and reaches the
# sequence when that step completes (Sequence.settle)
PENDING = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: InitVar[list[int]]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clamped to the context
    seed: int = 0  # 64 bits: the request's seed, or a random one (kernels/sampling.py keys its draws on it)
    sampler_slot: int | None = None  # its row of the sampler's tables, from first admission to finish
    grammar: GrammarMatcher | None = None  # what its reply must match (params.grammar), advanced token by token
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served from the prefix cache (first admission)
    speculation: Speculation | None = None  # None: it never drafts (off, penalties, a grammar)
    num_emitted: int = 0  # tokens of its reply the engine core has handed out (max_tokens bounds them)

    def __post_init__(self, prompt: list[int]) -> None:
        self.num_prompt_tokens = len(prompt)
        self._token_ids = list(prompt)  # confirmed
        self._drafts: list[int] = []
        self._tail: list[int] = []  # PENDING or forced, in order
        self._inflight = 0  # PENDING tokens in the tail

    # ---- read by everyone ----

    @property
    def token_ids(self) -> ReadOnly[int]:
        """The confirmed tokens: the prompt, then the generated tokens on the host."""
        return self._token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._token_ids[: self.num_prompt_tokens]

    @property
    def drafts(self) -> ReadOnly[int]:
        return self._drafts

    @property
    def generated(self) -> ReadOnly[int]:
        return self._token_ids[self.num_prompt_tokens :]

    @property
    def num_known(self) -> int:
        """Confirmed tokens: on the host and final."""
        return len(self._token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self._drafts)

    @property
    def num_inflight(self) -> int:
        """Tokens sampled by steps in flight, not yet on the host."""
        return self._inflight

    @property
    def num_forced(self) -> int:
        """Tokens its grammar forced after a token in flight, handed out with it."""
        return len(self._tail) - self._inflight

    @property
    def num_tokens(self) -> int:
        """Every token a step may compute: the confirmed ones and the tail."""
        return len(self._token_ids) + len(self._drafts) + len(self._tail)

    @property
    def num_generated(self) -> int:
        """The reply's tokens so far: confirmed, in flight and forced (drafts are not its tokens yet)."""
        return len(self._token_ids) + len(self._tail) - self.num_prompt_tokens

    @property
    def done_sampling(self) -> bool:
        """Every token it may generate is sampled (some may still be in flight): no step needs it any more."""
        return self.num_generated >= self.max_tokens

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, end: int) -> list[int]:
        """The ids at positions start .. end - 1, the tail's too (PENDING where a token is in flight)."""
        known = len(self._token_ids)
        if end <= known:
            return self._token_ids[start:end]
        return self._token_ids[start:] + (self._drafts + self._tail)[max(0, start - known) : end - known]

    # ---- the tail, changed by the model runner ----

    def propose(self, drafts: list[int]) -> None:
        """Drafts for the next step to verify, from the confirmed tokens (they replace any proposed before)."""
        assert not self._tail, "drafts follow the confirmed tokens: none may be in flight"
        self._drafts = list(drafts)

    def launch(self) -> None:
        """A step that samples its next token is launched: the token is in flight."""
        self._tail.append(PENDING)
        self._inflight += 1

    def force(self, run: list[int]) -> None:
        """Tokens its grammar forces after the last token in flight (and any run placed after it already)."""
        assert self._inflight and not self._drafts
        self._tail += run

    def settle(self, sampled: list[int]) -> list[int]:
        """The first token in flight arrived: `sampled` is its step's tokens for this sequence, the target's token
        at each draft and one after them. Returns the tokens now confirmed: the drafts those tokens confirm and the
        token after them; without drafts, the token and the run its grammar forced after it."""
        assert self._tail and self._tail[0] == PENDING
        if self._drafts:
            new = sampled[: accepted(self._drafts, sampled) + 1]
            self._drafts = []
            end = 1
        else:
            end = next((i for i in range(1, len(self._tail)) if self._tail[i] == PENDING), len(self._tail))
            new = [sampled[0], *self._tail[1:end]]
        del self._tail[:end]
        self._inflight -= 1
        self._token_ids += new
        return new

    def drop(self, keep_drafts: int = 0) -> None:
        """Forget the tail (drafts, tokens in flight, forced runs): it ends, is preempted, or the step has room for
        `keep_drafts` of its drafts alone. A draft model's cache then holds no K/V of the drafts that went."""
        del self._drafts[keep_drafts:]
        self._tail, self._inflight = [], 0
        if self.speculation is not None:
            self.speculation.draft_computed = min(self.speculation.draft_computed, self.num_known + keep_drafts)
