"""The scheduler's pacing (engine/serving/scheduler.py): prefill tokens beside decode rows are held to what keeps
a step within PACE decode steps, from the step times it is told; a prompt alone gets the whole budget."""

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.block_manager import BlockManager
from llamaterm.engine.serving.proposer import Proposer
from llamaterm.engine.serving.scheduler import MIN_PREFILL, PACE, Pace, ScheduledChunk, Scheduler
from llamaterm.engine.serving.sequence import Sequence
from llamaterm.engine.serving.speculation import NgramIndex, Speculation


def sequence(i: int, prompt: int) -> Sequence:
    """Prompts of their own tokens: no prefix shared with another's."""
    return Sequence(i, [1000 * i + t for t in range(prompt)], SamplingParams(max_tokens=50), 50)


def may_draft(s: Scheduler) -> bool:
    """The engine core's question before it schedules: would the next step's drafts pay for the overlap given up?"""
    return Proposer().may_draft(s.running, s.draft_rows())


def schedule(s: Scheduler) -> list[ScheduledChunk]:
    """A step as the engine core places it: drafts proposed by prompt lookup, then the step scheduled."""
    Proposer().propose(s.running, s.draft_rows())
    return s.schedule()


def sampled(seq: Sequence, token: int) -> None:
    """The model runner's part: a step samples the sequence's next token, and completes."""
    seq.launch()
    seq.settle([token])


def test_pace_learns_the_prefill_allowance():
    pace = Pace(2048)
    assert pace.prefill_tokens(8, 8) == 2048  # nothing measured yet
    for _ in range(50):
        pace.observe(32, 0, 0.0064)  # decode steps of 32 rows: 0.2 ms a row
        pace.observe(32, 400, 0.0064 + 0.04)  # 400 prefill tokens beside them: 0.1 ms a token
    # all 32 sessions decoding: a step may take PACE decode steps
    assert abs(pace.prefill_tokens(32, 32) - (PACE - 1) * 0.0064 / 0.0001) <= 3
    # 8 decoding while 24 wait: the step may take PACE times the step of all 32, so more tokens ride
    assert abs(pace.prefill_tokens(8, 32) - (PACE * 32 - 8) * 0.0002 / 0.0001) <= 3
    for _ in range(200):
        pace.observe(32, 400, 10.0)  # prefill turned very slow: prompts still move on
    assert pace.prefill_tokens(32, 32) == MIN_PREFILL


def test_prompts_beside_decodes_are_paced_and_alone_take_the_budget():
    s = Scheduler(BlockManager(1000, 16), max_batch_tokens=512, max_running=8)
    for _ in range(10):
        s.pace.observe(1, 0, 0.005)
        s.pace.observe(1, 300, 0.035)  # 0.1 ms a token: (2 * 2 - 1) * 5 ms / 0.1 ms = 150 tokens beside a decode
    first = sequence(1, 900)
    s.add(first)
    chunks = s.schedule()  # alone: the whole step budget
    assert [(c.seq.id, c.length) for c in chunks] == [(1, 512)]
    s.advance(chunks)
    s.advance(s.schedule())  # the rest of the prompt
    sampled(first, 5)  # its first sampled token: it decodes now
    s.add(sequence(2, 600))
    chunks = s.schedule()
    assert [(c.seq.id, c.length) for c in chunks] == [(1, 1), (2, 150)]  # one decode, then a paced chunk


def prompt_tokens_computed(s: Scheduler, seqs: list[Sequence]) -> int:
    """Steps until every sequence has its prompt computed (each samples a token after it); the prompt tokens the
    steps computed."""
    computed = 0
    while any(q.num_computed < q.num_prompt_tokens for q in seqs):
        chunks = s.schedule()
        assert chunks, "nothing scheduled while prompts wait"
        s.advance(chunks)
        for c in chunks:
            computed += c.length if c.seq.num_computed <= c.seq.num_prompt_tokens else 0
            if c.samples and c.seq.num_generated == 0:
                sampled(c.seq, 7)  # its first token
    return computed


def test_choices_of_one_prompt_compute_it_once():
    """n = 8 on a 512-token prompt (a request's choices arrive together): the prompt is computed once; the other
    choices fork from it in the step of its last chunk, which they sample beside."""
    s = Scheduler(BlockManager(1000, 16), max_batch_tokens=2048, max_running=16)
    prompt = [(7 * t) % 5000 for t in range(512)]
    choices = [Sequence(i, list(prompt), SamplingParams(max_tokens=50), 50) for i in range(8)]
    for q in choices:
        s.add(q)
    assert prompt_tokens_computed(s, choices) == 512
    assert [q.num_cached for q in choices] == [0] + [512] * 7
    assert all(q.table.block_ids == choices[0].table.block_ids for q in choices)  # 32 full blocks, shared


def test_a_fork_waits_for_the_last_chunk_and_copies_the_partial_last_block():
    """A 700-token prompt over two steps of 512: its copies wait through the first chunk, then fork beside the
    second; each shares the 43 full blocks and copies the 44th (12 tokens) into a block of its own."""
    blocks = BlockManager(100, 16)
    s = Scheduler(blocks, max_batch_tokens=512, max_running=4)
    prompt = [(3 * t) % 911 for t in range(700)]
    choices = [Sequence(i, list(prompt), SamplingParams(max_tokens=50), 50) for i in range(3)]
    for q in choices:
        s.add(q)
    first = s.schedule()
    assert [(c.seq.id, c.length) for c in first] == [(0, 512)]
    s.advance(first)
    second = s.schedule()
    assert [(c.seq.id, c.start, c.length) for c in second] == [(0, 512, 188), (1, 700, 0), (2, 700, 0)]
    parent = choices[0].table.block_ids
    copies = [c.block_copy for c in second[1:]]
    assert [src for src, _ in copies] == [parent[43]] * 2
    for q, (_, dst) in zip(choices[1:], copies, strict=True):
        assert q.table.block_ids == parent[:43] + [dst] and dst not in parent
    s.advance(second)
    assert all(blocks.blocks[b].ref_count == 3 for b in parent[:43]) and blocks.num_free == 100 - 44 - 2
    for q in choices:
        s.finish(q)
    assert blocks.num_free == 100 and all(b.ref_count == 0 for b in blocks.blocks.values())


def test_a_prompt_that_only_begins_like_one_being_computed_does_not_fork():
    s = Scheduler(BlockManager(100, 16), max_batch_tokens=512, max_running=4)
    a = Sequence(0, list(range(100)), SamplingParams(), 50)
    b = Sequence(1, list(range(100)) + [5], SamplingParams(), 50)
    s.add(a)
    s.add(b)
    assert [(c.seq.id, c.length) for c in s.schedule()] == [(0, 100)]  # b waits for a's 6 full blocks


def test_prompts_that_share_only_a_beginning_wait_for_it_alone():
    """Two prompts with a common 100-token beginning: the second waits for the first's 6 full blocks of it, then
    computes the rest; a prompt with nothing in common with them is not held up."""
    s = Scheduler(BlockManager(1000, 16), max_batch_tokens=2048, max_running=16)
    common = list(range(100, 200))
    a = Sequence(1, common + [1] * 300, SamplingParams(), 50)
    b = Sequence(2, common + [2] * 50, SamplingParams(), 50)
    other = sequence(3, 64)
    for q in (a, b, other):
        s.add(q)
    first = s.schedule()
    assert [(c.seq.id, c.length) for c in first] == [(1, 400), (3, 64)]  # b waits
    s.advance(first)
    sampled(a, 7)
    sampled(other, 7)
    assert prompt_tokens_computed(s, [b]) == 150 - 96 and b.num_cached == 96


def test_a_prompt_equal_to_a_sequence_with_its_drafts_does_not_fork_from_them():
    """A waiting prompt equal to a decoding sequence's tokens with the drafts it verifies in the step: forked, it
    would share the blocks that hold the drafts, which the sequence writes again once it rejects them. It computes
    its prompt instead, and every block a later step writes is its writer's alone."""
    blocks, spec = BlockManager(100, 4), Speculation()
    s = Scheduler(blocks, max_batch_tokens=64, max_running=4, speculate_tokens=8)
    a = Sequence(0, [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=50), 50, speculation=spec)
    s.add(a)
    s.advance(schedule(s))
    sampled(a, 1)  # its first token, on the host
    drafts = NgramIndex().propose(a.token_ids, a.num_known, spec.length.k(1))
    assert drafts == [2, 3, 1, 2]  # past a block's start: the block of tokens 4..7 holds the first
    b = Sequence(1, [*a.token_ids, *drafts], SamplingParams(max_tokens=50), 50)
    s.add(b)
    step = schedule(s)
    assert a.num_drafts == 4 and not any(c.seq is b and c.length == 0 for c in step)
    s.advance(step)
    a.launch()
    assert a.settle([9] * 5) == [9]  # the target rejected every draft: its token at the first one follows
    s.drop_rejected(a)
    sampled(b, 5)
    for c in schedule(s):
        written = {c.seq.table.block_ids[p // 4] for p in range(c.start, c.start + c.length)}
        others = {x for q in (a, b) if q is not c.seq for x in q.table.block_ids}
        assert not written & others, (c.seq.id, written & others)


def drafting_batch(n: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler of 8 rows for drafts and sequences, n of them running past their prompts, which repeat: a
    proposal may follow."""
    s = Scheduler(BlockManager(200, 16), max_batch_tokens=512, max_running=8, speculate_tokens=8)
    running = [Sequence(i, [1000 * i + t for t in range(10)] * 2, SamplingParams(max_tokens=50), 50) for i in range(n)]
    for q in running:
        q.speculation = Speculation()
        s.add(q)
    s.advance(schedule(s))
    return s, running


def test_no_overlap_is_given_up_for_drafts_the_step_has_no_room_for():
    """The engine completes the step in flight first when the next may carry drafts (may_draft); drafts ride only
    while the running and waiting sequences leave rows of speculate_tokens: 2 running with 6 waiting leave none."""
    s, _ = drafting_batch(2)
    assert may_draft(s)  # two decoding sequences that may draft
    for i in range(2, 8):
        s.waiting.append(sequence(i, 20))
    assert not may_draft(s)


def test_a_batch_gives_up_overlap_only_where_its_drafts_are_expected_to_pay_for_it():
    """Completing the step in flight costs a batch 0.95 of a step for every running sequence (0.95 tokens each);
    the drafts the next step has rows for bring their chances of being kept. 7 sequences at acceptance 0.6 have one
    row: 0.6 < 7 * 0.95; 2 have six: 0.6 + 0.6 + 0.36 + 0.36 + 0.216 + 0.216 = 2.352 > 2 * 0.95. At acceptance 0.45
    a sequence drafts two tokens, kept with chances 0.45 and 0.2025: 2 sequences 1.305 < 1.9; at 0.9, 3 sequences
    have five rows, 0.9 * 3 + 0.81 * 2 = 4.32 > 2.85."""
    s, running = drafting_batch(7)
    assert running[0].speculation.length.acceptance == 0.6
    assert not may_draft(s)
    for q in running:  # each sampled a token that continues its repeat: a proposal follows
        sampled(q, q.token_ids[10])
    step = schedule(s)
    assert [c.length for c in step] == [1] * 7  # nor does the step draft into its one row
    s.advance(step)
    for q in running:
        sampled(q, q.token_ids[11])
    s.running = s.running[:2]
    assert may_draft(s)
    assert sum(c.length - 1 for c in schedule(s)) == 6  # drafts in the six rows
    for q in running:
        q.speculation.length.acceptance = 0.45
    assert not may_draft(s)
    for q in running:
        q.speculation.length.acceptance = 0.9
    s.running = running[:3]
    assert may_draft(s)


def test_overlap_is_given_up_only_where_a_proposal_can_follow():
    """may_draft, with a token in flight: a sequence whose last known tokens never occurred before has no match to
    propose from once that token arrives, whatever it is, so the engine keeps overlapping its steps; one whose
    reply quotes its prompt may; one that pauses drafting does not."""
    s = Scheduler(BlockManager(100, 16), max_batch_tokens=512, max_running=8, speculate_tokens=8)
    q = sequence(0, 20)
    q.speculation = Speculation()
    s.add(q)
    s.advance(schedule(s))
    q.launch()  # its first token, in flight
    assert not may_draft(s)  # a prompt of distinct tokens
    q.settle([q.token_ids[5]])  # the reply quotes the prompt's 6th to 8th tokens, its fourth token in flight
    sampled(q, q.token_ids[6])
    sampled(q, q.token_ids[7])
    q.launch()
    assert may_draft(s)
    q.speculation.length.paused_until = q.num_generated + 1
    assert not may_draft(s)
