"""Drafts for the next step (speculative decoding, speculation.py): which sequences draft and how many tokens, by
prompt lookup or a draft model's steps (draft_model.py). The model runner calls it from tokens on the host, before
the scheduler places the step; the scheduler keeps the drafts its budget and free blocks allow. A draft model's
drafts are placeholders until the step launches: its steps write K/V in the blocks the scheduler gave them."""

from __future__ import annotations

from llamaterm.engine.serving.draft_model import DraftModel
from llamaterm.engine.serving.sequence import Sequence
from llamaterm.engine.serving.speculation import BATCH_OVERLAP_COST


class Proposer:
    def __init__(self, draft: DraftModel | None = None):
        self.draft = draft  # None: prompt lookup

    def may_draft(self, running: list[Sequence], rows: int) -> bool:
        """Whether to complete the step in flight before the next is scheduled, giving up the overlap of the two:
        drafts are proposed from tokens on the host. The drafts the step has `rows` for are expected to bring more
        tokens than that costs a batch, BATCH_OVERLAP_COST of a step of every running sequence. A draft is expected to
        bring the chance it is kept (DraftLength.chances); a sequence drafts when it is not pausing and, with prompt
        lookup, a proposal is likely to follow its known tokens. A lone sequence's drafting is its DraftLength's to
        weigh: it pauses when its drafts are seldom kept and starts again afresh, where a weighing here would hold it
        back for good on a low average (the offline replay of tests/benchmarks/draft_policy.py)."""
        if rows <= 0:
            return False
        chances = sorted(
            (
                chance
                for seq in running
                if (spec := seq.speculation) is not None
                and (self.draft is not None or spec.index.may_match(seq.token_ids, seq.num_known))
                for chance in spec.length.chances(seq.num_generated)
            ),
            reverse=True,
        )
        return sum(chances[:rows]) > (BATCH_OVERLAP_COST * len(running) if len(running) > 1 else 0.0)

    def propose(self, running: list[Sequence], rows: int) -> None:
        """Drafts for the running sequences that decode with every token on the host, in their order, while the
        step has `rows` for them (those a step samples beside a row per sequence). Drafts the last step did not
        place go."""
        for seq in running:
            if seq.num_drafts:
                seq.drop()
        drafting = [seq for seq in running if seq.speculation is not None and not seq.num_inflight]
        if not drafting or not self.may_draft(running, rows):
            return
        for seq in drafting:
            if rows <= 0:
                break
            if seq.done_sampling or seq.num_to_compute != 1 or (k := self._draft_length(seq, rows)) <= 0:
                continue
            assert seq.speculation is not None
            if self.draft is not None:
                drafts = [0] * k  # (fill() computes them)
            else:
                drafts = seq.speculation.index.propose(seq.token_ids, seq.num_known, k)
            if drafts:
                seq.propose(drafts)
                rows -= len(drafts)

    def fill(self, seqs: list[Sequence]) -> None:
        """The draft model's tokens for the drafts the step placed (a no-op with prompt lookup)."""
        if self.draft is not None and (drafting := [(seq, seq.num_drafts) for seq in seqs if seq.num_drafts]):
            self.draft.propose(drafting)

    @staticmethod
    def _draft_length(seq: Sequence, most: int) -> int:
        """Its adaptive draft length, within `most` and the tokens it has left (a sampled token follows them)."""
        assert seq.speculation is not None
        return min(most, seq.speculation.length.k(seq.num_generated), seq.max_tokens - seq.num_generated - 1)
