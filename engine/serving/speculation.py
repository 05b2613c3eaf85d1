"""Speculative decoding's parts: prompt lookup (`NgramIndex`: the tokens that followed the longest earlier match of
the sequence's last 3-8 tokens), verification (`accepted`: drafts kept while the target's tokens equal them), and
each sequence's adaptive draft length (`DraftLength`). The proposer (proposer.py) decides who drafts; README's How it
works has the design, BENCHMARKS.md the measurements behind its constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SPECULATE = ("off", "ngram", "draft")  # EngineConfig.speculate
MIN_NGRAM = 3  # the shortest suffix looked up: shorter matches' drafts are kept too seldom to pay
MAX_NGRAM = 8  # the longest: among matches this long or longer, the latest
MAX_DRAFT = 15  # tokens drafted per step at most
EWMA = 0.3  # weight of the newest step in a sequence's acceptance average
FIRST_ACCEPTANCE = 0.6  # the average a sequence starts from, and comes back to after a pause
MIN_ACCEPTANCE = 0.25  # below it, drafting pauses: the step's rows cost more than the tokens they bring
PAUSE_TOKENS = 32  # tokens decoded one at a time before drafting is tried again; doubled by each pause in a row
MAX_PAUSE_DOUBLINGS = 4
MIN_GAIN = 0.1  # a k-th draft is worth its row while it is kept with at least this chance (acceptance ** k)
# What a step costs more when it is launched after the one before completed on the host (drafts are proposed from
# tokens there) than beside it, in steps: the host's work no longer hides under the device's (tests/benchmarks/
# draft_policy.py weighs policies with it). A batch of n sequences that gives up its overlap pays BATCH_OVERLAP_COST
# * n tokens, and drafts where its drafts are expected to bring more (Proposer.may_draft). Both measured:
# BENCHMARKS.md's History.
OVERLAP_COST = 0.6
BATCH_OVERLAP_COST = 0.95


@dataclass
class NgramIndex:
    """The latest end position of every n-gram among a sequence's known tokens but for those that end at the last
    one (they are the suffix looked up, and have no follower yet): of MIN_NGRAM tokens for may_match, which the
    scheduler asks of every running sequence while a step could draft, and of MIN_NGRAM .. MAX_NGRAM for propose.
    Each is built on first use, which sequences that never draft do not pay."""

    latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # MIN_NGRAM .. MAX_NGRAM
    indexed: int = 0  # n-grams ending before this position are in `latest`
    short: dict[tuple[int, ...], int] = field(default_factory=dict)  # MIN_NGRAM
    short_indexed: int = 0

    def propose(self, tokens: Sequence[int], known: int, k: int) -> list[int]:
        """The k tokens that followed the latest earlier occurrence of the longest suffix of tokens[:known] that
        occurred before (n from MAX_NGRAM down to MIN_NGRAM); [] if none did."""
        if k <= 0 or known < 2:
            return []
        self.indexed = index(self.latest, range(MIN_NGRAM, MAX_NGRAM + 1), tokens, self.indexed, known)
        for n in range(min(MAX_NGRAM, known - 1), MIN_NGRAM - 1, -1):
            match = self.latest.get(tuple(tokens[known - n : known]))
            if match is not None:
                # past the known tokens the match's continuation is the drafts themselves: a run that repeats
                # with period known - 1 - match goes on repeating
                drafts: list[int] = []
                for at in range(match + 1, match + 1 + k):
                    drafts.append(tokens[at] if at < known else drafts[at - known])
                return drafts
        return []

    def may_match(self, tokens: Sequence[int], known: int) -> bool:
        """Whether the next token is likely to give tokens[:known] and it a suffix that propose finds: the last
        MIN_NGRAM known tokens occurred before, with a known token after them (if the next is that token, a match of
        MIN_NGRAM + 1 follows)."""
        if known <= MIN_NGRAM:
            return False
        self.short_indexed = index(self.short, (MIN_NGRAM,), tokens, self.short_indexed, known)
        return tuple(tokens[known - MIN_NGRAM : known]) in self.short


def index(
    latest: dict[tuple[int, ...], int], lengths: Sequence[int], tokens: Sequence[int], start: int, known: int
) -> int:
    """Record in `latest` the n-grams (n in lengths) of tokens[:known] that end at positions start .. known - 2
    (each has a known token after it); returns the position indexed up to."""
    for end in range(start, known - 1):
        for n in lengths:
            if n > end + 1:
                break
            latest[tuple(tokens[end - n + 1 : end + 1])] = end
    return max(start, known - 1)


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the target's tokens confirm: sampled[i] is the target's token at drafts[i]'s
    position (sampled has one more, the token after the last draft)."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass
class DraftLength:
    """How many tokens to draft for one sequence, from its measured acceptance a: the chance that a draft is kept
    when the one before it was (a step that keeps j of k drafts saw j such draws succeed, and one fail if j < k),
    averaged over steps (EWMA). The k-th draft is kept with chance about a ** k; drafts are proposed while that is
    at least MIN_GAIN. Below MIN_ACCEPTANCE drafting pauses
    for PAUSE_TOKENS tokens, twice that after a second pause in a row and so on, then starts again from
    FIRST_ACCEPTANCE (a reply may come to quote its prompt later). A pause lets the engine overlap its steps."""

    acceptance: float = FIRST_ACCEPTANCE
    paused_until: int = 0  # the generated-token count at which a pause ends
    pauses: int = 0  # in a row: drafting has not reached FIRST_ACCEPTANCE since

    def k(self, generated: int) -> int:
        if generated < self.paused_until:
            return 0
        k, chance = 0, self.acceptance
        while k < MAX_DRAFT and chance >= MIN_GAIN:
            k, chance = k + 1, chance * self.acceptance
        return k

    def chances(self, generated: int) -> list[float]:
        """Each of the next k drafts' chance to be kept (acceptance ** j for the j-th): the tokens it is expected
        to bring."""
        return [self.acceptance**j for j in range(1, self.k(generated) + 1)]

    def observe(self, drafted: int, kept: int, generated: int) -> None:
        if drafted == 0:
            return
        self.acceptance += EWMA * (kept / (kept + (kept < drafted)) - self.acceptance)
        if self.acceptance >= FIRST_ACCEPTANCE:
            self.pauses = 0
        elif self.acceptance < MIN_ACCEPTANCE:
            self.paused_until = generated + (PAUSE_TOKENS << min(self.pauses, MAX_PAUSE_DOUBLINGS))
            self.acceptance, self.pauses = FIRST_ACCEPTANCE, self.pauses + 1


@dataclass
class Speculation:
    """A sequence's drafting state: its n-gram index, its draft length, and what its drafts came to."""

    index: NgramIndex = field(default_factory=NgramIndex)
    length: DraftLength = field(default_factory=DraftLength)
    drafted: int = 0  # totals, for `llamaterm bench`
    kept: int = 0
    draft_computed: int = 0  # with a draft model: the tokens whose K/V are in its cache (draft_model.py)

    def observe(self, drafted: int, kept: int, generated: int) -> None:
        """A step verified `drafted` drafts and kept `kept`."""
        self.drafted, self.kept = self.drafted + drafted, self.kept + kept
        self.length.observe(drafted, kept, generated)
