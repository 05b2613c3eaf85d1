"""A draft model: a small model with the target's vocabulary that proposes a sequence's k tokens by k steps of its
own, on a KV cache laid out as the target's (the same block tables), each draw the target's draw from the draft's
logits, so the replies stay those without drafts (README's How it works). On CUDA its steps replay from graphs of
their own.
"""

from __future__ import annotations

from collections.abc import Sequence as ReadOnly

import torch

from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.model import DeviceStep, Model, Pieces, StepLists, run_through
from llamaterm.engine.serving.sampling import Sampler
from llamaterm.engine.serving.sequence import Sequence
from llamaterm.engine.serving.step_inputs import device_tensors
from llamaterm.kernels.dispatch import use_triton

FAMILY = "pick a draft model of the same family (its tokenizer), or --speculate ngram"


def check_vocabulary(draft: Tokenizer, target: Tokenizer, draft_name: str, target_name: str) -> None:
    """The draft must name tokens as the target does: the same count, each id the same bytes."""
    differs = f"the draft model {draft_name}'s vocabulary differs from {target_name}'s"
    if draft.vocab_size != target.vocab_size:
        raise LlamatermError(f"{differs} (size {draft.vocab_size} vs {target.vocab_size}): {FAMILY}")
    for i in range(target.vocab_size):
        if draft.token_bytes(i) != target.token_bytes(i):
            raise LlamatermError(
                f"{differs} (token {i}: {draft.token_text(i)!r} vs {target.token_text(i)!r}): {FAMILY}"
            )


class DraftModel:
    def __init__(
        self,
        model: Model,
        num_blocks: int,
        block_size: int,
        sampler: Sampler,
        max_running: int,
        max_batch_tokens: int,
        cuda_graphs: bool,
    ):
        self.model, self.block_size, self.sampler = model, block_size, sampler
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        # its steps replayed from CUDA graphs of their own, as the model's (cuda_graph.py): a bucket runs eagerly
        # until its graph is captured, a piece between two draft steps once steps have needed it
        self.graphs = None
        if cuda_graphs and use_triton(self.kv_cache):
            max_blocks = -(-model.config.context_length // block_size)
            self.graphs = StepGraphs(
                self._forward, self._sample, model.device, max_running, max_batch_tokens, max_blocks
            )

    def propose(self, wanted: list[tuple[Sequence, int]]) -> None:
        """k drafts for each (sequence, k) from the draft model: a step that catches the draft's cache up and samples
        the first, then a step a token."""
        seqs = [seq for seq, _ in wanted]
        drafts: list[list[int]] = [[] for _ in seqs]
        for i in range(max(k for _, k in wanted)):
            live = [j for j, (_, k) in enumerate(wanted) if k > i]
            chunks = []
            for j in live:
                seq = seqs[j]
                start = self._first_computed(seq) if i == 0 else seq.num_known + i - 1
                ids = seq.token_ids[start:] if i == 0 else drafts[j][-1:]
                chunks.append((seq, start, ids))
            for j, token in zip(live, self._step(chunks), strict=True):
                drafts[j].append(max(token, 0))  # -1: not finite; the target decides anyway
        for seq, proposed in zip(seqs, drafts, strict=True):
            seq.propose(proposed)
            assert seq.speculation is not None
            seq.speculation.draft_computed = seq.num_known + seq.num_drafts - 1

    @staticmethod
    def _first_computed(seq: Sequence) -> int:
        spec = seq.speculation
        assert spec is not None
        return min(spec.draft_computed, seq.num_known - 1)

    @torch.inference_mode()
    def _step(self, chunks: list[tuple[Sequence, int, ReadOnly[int]]]) -> list[int]:
        """Compute the tokens `ids` at positions start.. of each sequence in the draft's cache; sample the token
        after each."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        ends: list[int] = []
        qsl, rows = [0], []
        for seq, start, chunk in chunks:
            table, end = seq.table.block_ids, start + len(chunk)
            ids += chunk
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(qsl[-1] + end - start)
            rows.append(qsl[-1] - 1)
            ends.append(end)
        sampler_slots = [seq.sampler_slot for seq, _, _ in chunks]
        assert all(slot is not None for slot in sampler_slots)
        step = StepLists(
            ids,
            positions,
            slots,
            [seq.table.block_ids for seq, _, _ in chunks],
            ends,
            qsl,
            rows,
            sampler_slots,  # type: ignore[arg-type]
            ends,
            [],
            [],
        )
        graphs = self.graphs
        if graphs is None or not graphs.fits(step):
            device_step = device_tensors(step, self.model.device)
            return self._sample(device_step, run_through(self._forward(device_step))).tolist()
        bucket, device_step = graphs.prepare(step)
        tokens = graphs.run_sample(bucket, device_step, graphs.run_forward(bucket, device_step))
        out = tokens[: len(rows)].tolist()
        if graphs.pending(idle=False):  # the step is done (its tokens read): a piece of the captures' work
            graphs.background(idle=False)
        return out

    def _forward(self, step: DeviceStep) -> Pieces:
        return self.model.forward_pieces(step.inputs, self.kv_cache)

    def _sample(self, step: DeviceStep, logits: torch.Tensor) -> torch.Tensor:
        return self.sampler.sample(logits, step.sampler_slots, step.sample_positions)
