"""The CUDA graphs' machinery (engine/serving/cuda_graph.py), checked on the CPU: every step the scheduler can make
has a bucket, and padding stays under one 64-row matmul tile up to 512 tokens and under 256 tokens above; the
engine serves before any graph exists and captures in the background, between steps and when idle, the buckets in
use first. The CPU has no CUDA graphs: the capture alone is stubbed (the work is recorded as a callable that each
replay runs again over the live buffers); the padded buffers, the eager steps over them, the warm-ups and the
engine loop's scheduling of the pieces are the real ones (tests/engine/test_gpu_model.py captures for real)."""

import threading
import time

import pytest
import torch

from llamaterm.app.bench import format_serve_first
from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.cuda_graph import WAITING, StepGraphs, on_a_thread, token_buckets
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import StepLists, run_through
from llamaterm.engine.serving.synthetic_model import synthetic_model
from llamaterm.engine.synthetic import SyntheticTokenizer
from tests.support.graphs import record_without_running


@pytest.mark.parametrize(("max_batch", "max_tokens"), [(64, 2048), (8, 256), (48, 2048), (64, 100), (256, 4096)])
def test_every_step_size_has_a_tight_bucket(max_batch, max_tokens):
    buckets = token_buckets(max_batch, max_tokens)
    assert buckets[-1] == max_tokens and max_batch in buckets or max_batch > max_tokens
    for t in range(1, max_tokens + 1):
        bucket = min(b for b in buckets if b >= t)
        assert min(bucket, max_batch) >= min(t, max_batch)  # room for every sequence of the step
        if t <= 64:
            assert bucket < 2 * t or bucket == t  # pure decode sizes: powers of two
        elif t <= 512:
            assert bucket - t < 64
        else:
            assert bucket - t < 256


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture
def engines(monkeypatch):
    """An engine without graphs (the oracle) and one with StepGraphs on the CPU, captures stubbed: 4 sequences at
    most and 64 tokens a step, so the buckets are 1, 2, 4 (decodes), then 8 .. 64."""
    monkeypatch.setattr(StepGraphs, "_record", record_without_running)
    model = synthetic_model("tiny", True, torch.device("cpu"))
    # without drafts, which would take random weights' repeated tokens several a step
    config = EngineConfig(max_running=4, max_batch_tokens=64, cuda_graphs=False, speculate="off")
    eager = Engine(EngineCore(model, SyntheticTokenizer(model.config.vocab_size), config))  # type: ignore[arg-type]
    served = Engine(EngineCore(model, SyntheticTokenizer(model.config.vocab_size), config))  # type: ignore[arg-type]
    runner = served.core.runner
    max_blocks = -(-model.config.context_length // config.block_size)
    runner.graphs = StepGraphs(runner._forward, runner._sample, model.device, 4, 64, max_blocks)  # before a request
    yield eager, served, runner.graphs
    eager.shutdown()
    served.shutdown()


def generated(engine: Engine, prompt: list[int]):
    handle = engine.submit(None, GREEDY, prompt_ids=prompt)
    events = list(handle.events())
    assert events[-1].finish_reason == "length", events[-1]
    return [t for e in events for t in e.token_ids], handle


def wait_idle_work(engine: Engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.core.runner.background_pending(idle=True):
        assert time.monotonic() < deadline, "the background captures did not finish"
        time.sleep(0.01)


def test_a_request_is_answered_before_any_graph_and_as_without_graphs(engines):
    eager, served, graphs = engines
    prompt = list(range(5, 25))  # 20 tokens: the 32 bucket, then decodes in the 1 bucket
    expected, _ = generated(eager, prompt)
    tokens, handle = generated(served, prompt)
    assert tokens == expected
    first_token = handle.first_token
    assert first_token is not None and min(graphs.ready_at.values()) > first_token  # served first, captured later
    # its decode bucket was captured after its first decode step, a piece between steps, and the steps launched
    # after that replayed it: every token read after it was ready but the two steps then launched, eager
    after = sum(t > graphs.ready_at[1] for t in handle.token_times)
    assert graphs.graphs[1].forward.replays == graphs.graphs[1].sample.replays >= max(1, after - 2)


def test_graphs_are_captured_in_use_first_and_the_rest_when_idle(engines):
    eager, served, graphs = engines
    prompt = list(range(30, 50))
    _, handle = generated(served, prompt)
    busy = {b for b, t in graphs.ready_at.items() if t < handle.end}
    assert busy == {1}  # while it ran, only the bucket its steps used: a one-shot command's steps make way for it
    wait_idle_work(served)
    assert sorted(graphs.graphs) == [1, 2, 4]  # idle: every decode bucket; not 32, which one step used
    assert graphs.ready_at[2] < graphs.ready_at[4] and graphs.uses[32] == 1
    # a second prompt of that size: its bucket is captured now, and replays give the eager path's tokens
    other = list(range(60, 80))
    expected, _ = generated(eager, other)
    assert generated(served, other)[0] == expected
    wait_idle_work(served)
    assert 32 in graphs.graphs and graphs.uses[32] == 2
    assert generated(served, prompt[::-1])[0] == generated(eager, prompt[::-1])[0]
    assert graphs.graphs[32].forward.replays == 1
    assert served.core.block_manager.num_free == served.core.block_manager.num_blocks


def test_the_bench_times_the_captures_while_sessions_run(engines):
    """engine/bench.py's graphs_timeline (what `llamaterm bench` prints as serve-first figures): 3 sessions from
    start-up use the 4 bucket, captured while they run; the engine's stats say when, and what a capture held up."""
    _, served, graphs = engines
    sessions = wl.Sessions(served, False, wl.GREEDY, served.core.model.config.vocab_size)
    timeline = wl.graphs_timeline(sessions, 3, 8, seconds=1.5)
    ready = timeline["graphs_ready_s"]
    assert 4 in ready and ready == {b: t - served.core.ready_at for b, t in graphs.ready_at.items()}
    # full speed: the sessions' own step size captured, and no step size in use left to capture as they ended;
    # others may be captured after, as the engine idles
    assert ready[4] <= timeline["full_graph_speed_s"] <= max(ready.values())
    # the work's pieces beside steps (a graph step may or may not have been beside them: the 4 bucket's pieces can
    # all come beside eager steps, and nothing else in use is left to capture after them)
    assert timeline["normal_step_ms"] > 0 and timeline["slowest_piece"][0] > 0
    assert timeline["max_step_background_ms"] >= 0 and timeline["max_background_turn_ms"] >= 0
    assert timeline["slowest_piece"][1].split(",")[0] in {
        f"{kind} of {b}" for kind in ("warm-up", "capture") for b in graphs.buckets
    }

    assert timeline["pending_after"] == len(graphs.wanted(idle=True))
    assert wl.wait_for_graphs(sessions) < 20 and served.step_stats().graphs_pending == 0
    lines = format_serve_first({"first_answer_s": 0.5, **timeline, "idle_captures_s": 0.1})
    assert lines[0].startswith("first answer 0.50 s after the imports; 3 sessions") and "4 " in lines[1]


def test_a_step_of_more_rows_than_the_largest_bucket_holds_runs_eagerly(engines):
    """A fork samples a row of its own with no token (scheduler._fork), so a step of few tokens can have more rows
    than its bucket has sequences: with 2 tokens a step at most, the largest bucket holds 2 sequences, and a step
    of 2 tokens and 3 rows does not fit it (it runs eagerly) where one of 2 rows does."""
    _, served, _ = engines
    runner = served.core.runner
    graphs = StepGraphs(runner._forward, runner._sample, runner.model.device, 4, 2, 4)

    def step(rows: int) -> StepLists:
        ids = [5, 6]
        return StepLists(
            ids,
            [0, 0],
            [0, 16],
            [[0], [1]] + [[1]] * (rows - 2),
            [1, 1] + [1] * (rows - 2),
            [0, 1, 2] + [2] * (rows - 2),
            [0, 1] + [1] * (rows - 2),
            list(range(rows)),
            [1] * rows,
            [],
            [],
        )

    assert graphs.fits(step(2)) and not graphs.fits(step(3))


def test_a_bucket_is_warmed_and_captured_half_a_layer_at_a_time(engines):
    """The background work comes in pieces of half a layer's kernels at most, so that a turn of it between two steps can
    be short: with no time to spend, each turn is one piece; with time, a turn goes on to the next bucket."""
    _, served, _ = engines
    runner = served.core.runner
    layers = len(runner.model.layers)
    graphs = StepGraphs(runner._forward, runner._sample, runner.model.device, 4, 64, 4)
    turns = 0
    while 1 not in graphs.graphs:
        assert graphs.pending(idle=True)
        graphs.background(0.0)
        turns += 1
    # warm-up, then capture: each a piece a half layer, one for the logits and one for the sampler
    assert 1 in graphs.warmed and turns == 2 * (2 * layers + 2)
    assert graphs.wanted() == [2, 4]
    graphs.background(60.0)
    assert sorted(graphs.graphs) == [1, 2, 4] and not graphs.pending(idle=True)


def test_work_on_a_thread_is_waited_for_a_turn_at_a_time():
    """A graph's instantiation runs on a thread of its own (cuda_graph.on_a_thread): each piece of the job only
    looks whether it is done, and says it is waiting, so the turn ends there; its error reaches the job."""
    gate = threading.Event()
    job = on_a_thread(gate.wait)
    assert next(job) is WAITING and next(job) is WAITING
    gate.set()
    assert all(piece is WAITING for piece in job)  # (until the thread has ended)
    with pytest.raises(ZeroDivisionError):
        run_through(on_a_thread(lambda: 1 / 0))
