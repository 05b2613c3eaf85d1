"""Which prompt-lookup drafting policy pays, measured offline on the CPU: the default model's replies to the requests
of `llamaterm bench --speculate` (editing texts with a name changed, open chat; greedy, and sampled at the model's
defaults with request i's seed i), replayed step by step under each policy.

    python -m tests.benchmarks.draft_policy                         # about 2 minutes on 2 cores
    python -m tests.benchmarks.draft_policy --replies /tmp/r.json   # keeps the replies for the next run

A reply is the same tokens with or without drafts (greedy, or seeded: engine/serving/speculation.py), and a draft is
kept exactly when it is the token the reply has at its position, so how a policy would have drafted, and how many
of its drafts the model would have kept, follow from the replies alone. Per workload, per policy: tokens a step (as
`bench` counts them: a reply's tokens over its steps, the prompt's included), drafts a step, the drafts kept, the
steps that gave up overlap with no drafts to show for it, and the speed-up over decoding without drafts by this cost
model of one session on the H200: a plain step (launched while the one before runs) costs 1; one launched after the
step before was completed on the host costs 1 + speculation.OVERLAP_COST (that step had drafts, or the engine saw
that the next one may draft: scheduler.py's may_draft), plus 0.01 a draft row. Where that comes from: BENCHMARKS.md,
the default model at one session with its kernels launched dependent: a plain step 0.91 ms, one completed before
the next 0.55-0.6 ms more, mostly the host's work no longer hidden under the device's (before dependent launches,
1.08 and 0.19 ms); and verify_step (8B shapes): 8 rows 1.09x one row, about 0.01 a row.

The policies vary the lookup (the shortest and longest suffix matched; "all": the longest match over every earlier
occurrence; "prompt first": among matches as long, the prompt's), the draft length (the engine's DraftLength, or
always the most), whether a sequence pauses after drafts that were not kept, and when the engine gives up overlap:
"when not paused" (before: whenever a sequence may draft, whatever its tokens) or "where a match can follow" (now:
NgramIndex.may_match). The row "engine" runs speculation.py's own classes. The last row is the most any policy of the
widest lookup could give: each step drafts exactly the drafts that will be kept, and only where some will be.
"""

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving import speculation
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.speculation import DraftLength, Speculation

SYNCED, ROW = speculation.OVERLAP_COST, 0.01  # a step launched after the one before completed, a draft row
EDITS = Path(__file__).parent / "editing"


@dataclass(frozen=True)
class Reply:
    workload: str
    sampling: str
    tokens: list[int]  # prompt, then reply
    prompt: int


def replies(max_tokens: int, per_prompt: int) -> list[Reply]:
    """bench's requests, without drafts: greedy once per prompt, sampled per_prompt times per prompt (request i:
    prompt i % prompts, seed i, as bench --speculate submits them)."""
    edits = [wl.EditText.read(p.name, p.read_text()) for p in sorted(EDITS.glob("*.txt"))]
    out = []
    with Engine.from_model(EngineConfig(device="cpu", speculate="off", max_batch_tokens=1024)) as engine:
        for workload, prompts in wl.speculation_workloads(edits).items():
            for sampling, values in wl.SPECULATION_SAMPLINGS.items():
                n = len(prompts) * (1 if sampling == "greedy" else per_prompt)
                params = [SamplingParams(max_tokens=max_tokens, seed=i, **values) for i in range(n)]
                asked = [prompts[i % len(prompts)] for i in range(n)]
                handles = [engine.submit(prompt, params[i]) for i, prompt in enumerate(asked)]
                for prompt, h in zip(asked, handles, strict=True):
                    list(h.events())
                    ids = engine.encode_prompt(prompt)
                    out.append(Reply(workload, sampling, ids + h.token_ids, len(ids)))
    return out


@dataclass(frozen=True)
class Policy:
    name: str
    min_n: int = speculation.MIN_NGRAM
    max_n: int | None = speculation.MAX_NGRAM  # None: every earlier occurrence's whole match
    prompt_first: bool = False
    most: int = EngineConfig.speculate_tokens - 1  # drafts a step at one session: speculate_tokens' rows but its own
    adapt: bool = True  # DraftLength's k; else always `most`
    pause: bool = True
    sync: str = "may match"  # or "not paused"


class Drafter:
    """A policy's drafting state for one reply (the lookup by brute force; the draft length the engine's)."""

    def __init__(self, policy: Policy, prompt: int):
        self.policy, self.prompt, self.length = policy, prompt, DraftLength()

    def match(self, tokens: list[int], known: int) -> tuple[int, int] | None:
        """(end, length) of the chosen earlier occurrence of a suffix of tokens[:known] of at least min_n tokens."""
        p, best = self.policy, None
        for end in range(known - 2, -1, -1):  # latest first
            n = 0
            while end - n >= 0 and tokens[end - n] == tokens[known - 1 - n] and (p.max_n is None or n < p.max_n):
                n += 1
            if n >= p.min_n and (
                best is None or n > best[1] or (p.prompt_first and n == best[1] and end < self.prompt)
            ):
                best = (end, n)
        return best

    def propose(self, tokens: list[int], known: int, k: int) -> list[int]:
        found = self.match(tokens, known) if k > 0 else None
        if found is None:
            return []
        drafts: list[int] = []
        for at in range(found[0] + 1, found[0] + 1 + k):
            drafts.append(tokens[at] if at < known else drafts[at - known])
        return drafts

    def k(self, generated: int) -> int:
        return min(self.policy.most, self.length.k(generated) if self.policy.adapt else self.policy.most)

    def observe(self, drafted: int, kept: int, generated: int) -> None:
        self.length.observe(drafted, kept, generated)
        if not self.policy.pause:
            self.length.paused_until = 0

    def may_draft(self, tokens: list[int], known: int, generated: int) -> bool:
        """The engine's may_draft for this sequence, one token in flight after tokens[:known]."""
        if self.k(generated) == 0:
            return False
        if self.policy.sync == "not paused":
            return True
        m = self.policy.min_n - 1  # a match of min_n can follow iff the last min_n - 1 tokens occurred before
        return known > m and any(
            tokens[e - m + 1 : e + 1] == tokens[known - m : known] for e in range(m - 1, known - 1)
        )


class EngineDrafter:
    """speculation.py's own Speculation, under the policy "engine" (what the scheduler asks of it)."""

    def __init__(self, policy: Policy, prompt: int):
        self.spec, self.most = Speculation(), policy.most

    def propose(self, tokens: list[int], known: int, k: int) -> list[int]:
        return self.spec.index.propose(tokens, known, k)

    def k(self, generated: int) -> int:
        return min(self.most, self.spec.length.k(generated))

    def observe(self, drafted: int, kept: int, generated: int) -> None:
        self.spec.observe(drafted, kept, generated)

    def may_draft(self, tokens: list[int], known: int, generated: int) -> bool:
        return self.spec.length.k(generated) > 0 and self.spec.index.may_match(tokens, known)


@dataclass
class Steps:
    tokens: int = 0  # reply tokens
    steps: int = 0  # decode steps (the prefill step not counted)
    cost: float = 0.0  # in plain steps
    drafted: int = 0
    kept: int = 0
    idle: int = 0  # steps launched after a completed one, without drafts

    def add(self, other: "Steps") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


def replay(reply: Reply, drafter) -> Steps:
    """One session's steps through the reply: a step completes before the next is scheduled where it had drafts or
    where the next may draft (engine.py); only then can the next draft (its tokens all on the host)."""
    t, out = reply.tokens, Steps(tokens=len(reply.tokens) - reply.prompt)
    known, synced = reply.prompt + 1, False  # the first token comes from the prefill step
    while known < len(t):
        generated = known - reply.prompt
        synced = synced or drafter.may_draft(t, known - 1, generated)  # the engine sees all but the token in flight
        k = min(drafter.k(generated), len(t) - known - 1) if synced else 0  # max_tokens: the reply's length
        drafts = drafter.propose(t, known, k)
        kept = 0
        while kept < len(drafts) and t[known + kept] == drafts[kept]:
            kept += 1
        known += kept + 1
        if drafts:
            drafter.observe(len(drafts), kept, known - reply.prompt)
        out.steps, out.drafted, out.kept = out.steps + 1, out.drafted + len(drafts), out.kept + kept
        out.cost += 1 + SYNCED * synced + ROW * len(drafts)
        out.idle += synced and not drafts
        synced = bool(drafts)
    return out


def foresight(reply: Reply, most: int) -> Steps:
    """The least cost of any drafting of the widest lookup (every earlier occurrence, a match of one token or more):
    each step drafts what will be kept, or nothing (dynamic programming over the reply's positions)."""
    t, start, end = reply.tokens, reply.prompt + 1, len(reply.tokens)
    lookup = Drafter(Policy("all", min_n=1, max_n=None), reply.prompt)
    runs = {}
    for known in range(start, end):
        drafts, run = lookup.propose(t, known, min(most, end - known - 1)), 0
        while run < len(drafts) and t[known + run] == drafts[run]:
            run += 1
        runs[known] = run
    best = {(end, False): Steps(), (end, True): Steps()}  # (position, step before had drafts): the rest's steps
    for known in range(end - 1, start - 1, -1):
        for synced in (False, True):
            plain = best[(known + 1, False)]
            options = [(1 + SYNCED * synced + plain.cost, 0, plain)]
            if runs[known]:
                rest = best[(known + runs[known] + 1, True)]
                options.append((1 + SYNCED + ROW * runs[known] + rest.cost, runs[known], rest))
            cost, k, rest = min(options, key=lambda o: o[0])
            best[(known, synced)] = Steps(0, rest.steps + 1, cost, rest.drafted + k, rest.kept + k)
    out = best[(start, True)]
    out.tokens = end - reply.prompt
    return out


def policies() -> list[Policy]:
    before = Policy("before: n 1..3, sync when not paused", min_n=1, max_n=3, sync="not paused")
    now = Policy("n 3..8, sync where a match can follow")
    return [
        before,
        replace(before, name="n 1..8", max_n=8),
        replace(before, name="n 1..all", max_n=None),
        replace(before, name="n 1..all, prompt first", max_n=None, prompt_first=True),
        replace(before, name="n 2..8", min_n=2, max_n=8),
        replace(before, name="n 3..8", min_n=3, max_n=8),
        replace(now, name="n 2..8, sync where a match can follow", min_n=2),
        now,
        replace(now, name="n 4..8, sync where a match can follow", min_n=4),
        replace(now, name="n 3..all, sync where a match can follow", max_n=None),
        replace(now, name="  and the prompt first", max_n=None, prompt_first=True),
        replace(now, name="  no pause", pause=False),
        replace(now, name="  k always the most", adapt=False),
        replace(now, name="  7 drafts (speculate_tokens 8)", most=7),
        replace(now, name="engine"),
    ]


@contextmanager
def draft_cap(most: int) -> Iterator[None]:
    """DraftLength's MAX_DRAFT raised to `most` where a policy drafts more."""
    with mock.patch.object(speculation, "MAX_DRAFT", max(most, speculation.MAX_DRAFT)):
        yield


def table(data: list[Reply]) -> None:
    groups = sorted({(r.workload, r.sampling) for r in data}, key=lambda g: (g[0] != "editing", g[1]))
    for workload, sampling in groups:
        group = [r for r in data if (r.workload, r.sampling) == (workload, sampling)]
        print(f"\n{workload}, {sampling}: {len(group)} replies, {sum(len(r.tokens) - r.prompt for r in group)} tokens")
        print(f"{'policy':42} {'tok/step':>8} {'drafts/step':>11} {'kept':>5} {'idle syncs':>10} {'speed-up':>8}")
        rows = [(p.name, p) for p in policies()] + [("foresight (the most any policy could)", None)]
        for name, policy in rows:
            total = Steps()
            for r in group:
                if policy is None:
                    total.add(foresight(r, Policy("").most))
                    continue
                with draft_cap(policy.most):
                    total.add(replay(r, (EngineDrafter if name == "engine" else Drafter)(policy, r.prompt)))
            print(
                f"{name:42} {total.tokens / (total.steps + len(group)):8.2f} {total.drafted / total.steps:11.2f} "
                f"{100 * total.kept / max(1, total.drafted):4.0f}% {100 * total.idle / total.steps:9.0f}% "
                f"{(total.tokens - len(group)) / total.cost:7.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="a reply's most tokens (bench's --tokens)")
    parser.add_argument("--per-prompt", type=int, default=8, help="sampled replies per prompt (seeds)")
    parser.add_argument("--replies", type=Path, help="a JSON file of replies: read if there, else written")
    args = parser.parse_args()
    if args.replies and args.replies.exists():
        data = [Reply(**r) for r in json.loads(args.replies.read_text())]
    else:
        t = time.perf_counter()
        data = replies(args.tokens, args.per_prompt)
        print(f"replies without drafts: {time.perf_counter() - t:.0f} s")
        if args.replies:
            args.replies.write_text(json.dumps([r.__dict__ for r in data]))
    print(f"cost model (one session, H200): a step 1, after a completed step {1 + SYNCED}, a draft row {ROW}")
    table(data)


if __name__ == "__main__":
    main()
