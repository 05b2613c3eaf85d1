"""What an engine's steps did, for `llamaterm bench`: how many, their host time, speculation's drafts, the grammars'
masks, the CUDA graphs' background work. Apart from EngineStats (engine/api.py), the callers' contract: an engine
that has steps offers these through step_stats()."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine process's parent unpickles StepStats without torch
    from llamaterm.engine.serving.model_runner import LaunchedStep, ModelRunner

RATE_WINDOW_S = 2.0  # sliding window for the aggregate tokens/s


@dataclass(frozen=True)
class StepStats:
    steps: int = 0  # steps run so far
    host_s: float = 0.0  # of the engine loop's time so far, what it spent on the host (not waiting for the device)
    drafted: int = 0  # draft tokens verified so far (speculative decoding), and of them those kept
    kept: int = 0
    draft_steps: int = 0  # steps that verified drafts
    serial_steps: int = 0  # steps completed before the next was scheduled, as drafts were verified or may follow
    # steps under a grammar so far, and their host time summed: masks filling (on their own thread), the engine
    # waiting for the tokens the masks start from, and waiting for the masks (engine/serving/model_runner.py)
    mask_steps: int = 0
    mask_fill_s: float = 0.0
    mask_tokens_s: float = 0.0
    mask_wait_s: float = 0.0
    forced_tokens: int = 0  # tokens grammars forced, computed without sampling (fast-forward)
    # CUDA graphs captured in the background (engine/serving/cuda_graph.py): (step size, seconds after the engine
    # was ready) of each graph captured, the graphs still to capture (of them, those of step sizes in use, which
    # serving captures first), the longest graph decode step that the work ran beside, its longest turn beside a
    # graph step, and its slowest piece beside a step (seconds, what)
    graphs_ready_s: tuple[tuple[int, float], ...] = ()
    graphs_pending: int = 0
    graphs_in_use_pending: int = 0
    max_step_background_s: float = 0.0
    max_background_turn_s: float = 0.0
    slowest_background_piece: tuple[float, str] = (0.0, "")


class StepRecorder:
    """The engine loop's instruments, read by stats() and step_stats() from other threads."""

    def __init__(self) -> None:
        self.steps = 0
        self.batch = 0  # sequences in the last step
        self.drafted = self.kept = 0
        self.draft_steps = self.serial_steps = 0
        self.host_s = 0.0
        self.wait_s = 0.0  # this loop turn's wait for the device
        # the longest step so far, from its scheduling (or the end of the step it queued behind) to its sampled
        # tokens on the host; benchmarks reset it
        self.max_step_s = 0.0
        self.last_done = 0.0  # when the last step's tokens were read
        # the longest decode step replayed from graphs that the graphs' background work (ModelRunner.background)
        # ran beside, and its longest turn beside a graph step; when it last ran (start, end); the times of the last
        # graph steps without it, whose median sets its turns' budget
        self.max_step_background_s = 0.0
        self.max_background_turn_s = 0.0
        self.background = (0.0, 0.0)
        self.graph_steps_s: deque[float] = deque(maxlen=16)
        # (time, tokens) of the steps of the last RATE_WINDOW_S, and their tokens' sum: stats() is read after every
        # step (the engine process's forwarder, beside the engine's thread), so it adds no loop over them
        self.step_tokens: deque[tuple[float, int]] = deque()
        self.window_tokens = 0

    def turn_started(self) -> float:
        self.wait_s = 0.0
        return time.perf_counter()

    def turn_ended(self, start: float, background_s: float) -> None:
        """A loop turn's host time: less its waits for the device and the graphs' background work in it."""
        self.host_s += time.perf_counter() - start - self.wait_s - background_s

    def completed(self, step: LaunchedStep, after: LaunchedStep | None, waited_from: float) -> float | None:
        """A step's tokens on the host, waited for since `waited_from`; `after`: the step launched while it ran.
        Returns its time where the graphs' background work did not hold it up (the scheduler's pace learns from it),
        else None."""
        now = time.perf_counter()
        self.wait_s += now - waited_from
        step_s = now - max(step.start, self.last_done)  # with overlap, about the step's time on the device
        self.max_step_s = max(self.max_step_s, step_s)
        self.last_done = now
        self.drafted, self.kept = self.drafted + step.verified, self.kept + step.kept
        self.draft_steps += step.has_drafts
        # a graph step's time, unless an eager launch after it held its tokens up (a whole step's Python)
        graphed = step.graphed and (after is None or after.graphed)
        if self.background[1] > now - step_s:  # the graphs' background work may have held this step up
            if graphed and not step.prefill_tokens:  # (a decode step, whose usual time is a session's token gap)
                self.max_step_background_s = max(self.max_step_background_s, step_s)
            return None
        if graphed:
            self.graph_steps_s.append(step_s)
        return step_s

    def tokens(self, count: int) -> None:
        now = time.perf_counter()
        self.step_tokens.append((now, count))
        self.window_tokens += count
        while now - self.step_tokens[0][0] > RATE_WINDOW_S:
            self.window_tokens -= self.step_tokens.popleft()[1]

    def tokens_per_s(self) -> float:
        now = time.perf_counter()
        try:  # (the engine's thread may empty the window meanwhile)
            first, last = self.step_tokens[0][0], self.step_tokens[-1][0]
        except IndexError:
            first = last = now
        span = now - first if now - last <= RATE_WINDOW_S else 0.0  # no step for a whole window: no rate
        return self.window_tokens / span if span > 0.05 else 0.0

    def graph_step_s(self) -> float:
        """A graph step's usual time: the median of the last ones."""
        return statistics.median(self.graph_steps_s or [0.0])

    def background_ran(self, start: float, end: float, beside_graph_step: bool) -> None:
        self.background = (start, end)
        if beside_graph_step:
            self.max_background_turn_s = max(self.max_background_turn_s, end - start)

    def snapshot(self, runner: ModelRunner, ready_at: float) -> StepStats:
        masks, graphs = runner.mask_times, runner.graphs
        stats = StepStats(
            steps=self.steps,
            host_s=self.host_s,
            drafted=self.drafted,
            kept=self.kept,
            draft_steps=self.draft_steps,
            serial_steps=self.serial_steps,
            mask_steps=masks.steps,
            mask_fill_s=masks.fill_s,
            mask_tokens_s=masks.tokens_s,
            mask_wait_s=masks.wait_s,
            forced_tokens=masks.forced_tokens,
        )
        if graphs is None:
            return stats
        ready = sorted(list(graphs.ready_at.items()))  # (a copy first: the loop may add one meanwhile)
        return replace(
            stats,
            graphs_ready_s=tuple((bucket, t - ready_at) for bucket, t in ready),
            graphs_pending=len(graphs.wanted(idle=True)),
            graphs_in_use_pending=len(graphs.wanted(idle=False)),
            max_step_background_s=self.max_step_background_s,
            max_background_turn_s=self.max_background_turn_s,
            slowest_background_piece=graphs.slowest_piece,
        )
