"""What verifying k drafts costs: one sequence's step of 1 + k tokens, every position sampled (as speculative
decoding runs it, engine/serving/speculation.py), against its one-token decode step, both replayed from the
engine's CUDA graphs (the forward pass, then the sampler) at `--context` tokens of context.

    python -m tests.benchmarks.verify_step -m synthetic:llama3-8b --drafts 0,1,2,4,7 --context 512

Per row: the tokens in the step, the bucket it pads to, the forward and sampler graphs' times, the step's time over
the one-token step's (issue #25's bar: 1 + 4 tokens within 1.2x), and the break-even acceptance: the share of drafts
kept (each kept with that chance, independently) at which the step yields as many tokens per second as decoding.
With `--sessions S`, S sequences each verify their drafts in one step.
"""

import argparse
import time

import torch

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.model import StepLists
from tests.benchmarks.step_profile import replay_ms


def verify_step(sessions: int, drafts: int, context: int, block_size: int) -> StepLists:
    """S sequences of `context` known tokens, each computing its last token and `drafts` drafts, each position a
    sampled row (sampler slot: the sequence's); blocks of their own (the values do not matter for speed)."""
    step = StepLists([], [], [], [], [], [0], [], [], [], [], [])
    for s in range(sessions):
        start, end = context - 1, context + drafts
        first = s * -(-(end + 1) // block_size)
        table = list(range(first, first + -(-end // block_size)))
        step.input_ids.extend([1] * (end - start))
        step.positions.extend(range(start, end))
        step.slot_mapping.extend(table[q // block_size] * block_size + q % block_size for q in range(start, end))
        step.block_tables.append(table)
        step.context_lens.append(end)
        step.query_start_loc.append(step.query_start_loc[-1] + end - start)
        step.logits_indices.extend(range(step.query_start_loc[-2], step.query_start_loc[-1]))
        step.sampler_slots.extend([s] * (end - start))
        step.sample_positions.extend(range(start + 1, end + 1))
    return step


def graph_ms(engine, step: StepLists) -> tuple[int, float, float]:
    """The bucket, and its forward and sampler graphs' times (captured here if the engine has not yet)."""
    graphs = engine.core.runner.graphs
    bucket, _ = graphs.prepare(step)
    if bucket not in graphs.graphs:
        graphs.warm(bucket)
        graphs.capture(bucket)
        graphs.prepare(step)  # the step's metadata in the buffers the graphs read
    g = graphs.graphs[bucket]
    return bucket, replay_ms(g.forward, 50), replay_ms(g.sample, 50)


def wait_for_captures(engine, timeout: float = 300.0) -> None:
    """The engine captures its decode graphs in the background once idle: done before this script uses them."""
    deadline = time.monotonic() + timeout
    while engine.core.runner.background_pending(idle=True):
        assert time.monotonic() < deadline, "the engine's background captures did not finish"
        time.sleep(0.05)


def decode_engine(model: str, sessions: int, context: int) -> wl.Bench:
    """An engine on CUDA with room for `sessions` sequences of `context` tokens, its decode graphs captured."""
    config = EngineConfig(kv_tokens=sessions * (context + 64) + 1024, max_running=64, speculate="off")
    bench = wl.open_engine(model, "cuda", config)
    assert bench.engine.core.runner.graphs is not None, "CUDA graphs are needed (a CUDA device)"
    wait_for_captures(bench.engine)
    return bench


def break_even(ratio: float, drafts: int) -> float | None:
    """The acceptance a at which (1 - a^(k+1)) / (1 - a) tokens per step pay for a step `ratio` times as long."""
    tokens = lambda a: sum(a**i for i in range(drafts + 1))
    if drafts == 0 or tokens(1.0) < ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if tokens(mid) >= ratio else (mid, hi)
    return hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="synthetic:llama3-8b")
    parser.add_argument("--drafts", default="0,1,2,3,4,7", help="drafts per sequence, comma-separated; 0 first")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--sessions", type=int, default=1)
    args = parser.parse_args()
    bench = decode_engine(args.model, args.sessions, args.context)
    engine = bench.engine
    try:
        print(f"{bench.label}: {args.sessions} session(s), {args.context} tokens of context, CUDA graphs")
        print(
            f"{'drafts':>6} {'tokens':>6} {'bucket':>6} {'forward ms':>10} {'sample ms':>9} {'step ms':>8} "
            f"{'vs decode':>9} {'break-even acceptance':>22}"
        )
        base = None
        for k in (int(x) for x in args.drafts.split(",")):
            step = verify_step(args.sessions, k, args.context, engine.core.block_manager.block_size)
            bucket, forward, sample = graph_ms(engine, step)
            total = forward + sample
            base = base or total  # the first row's
            ratio = total / base
            even = break_even(ratio, k)
            print(
                f"{k:6d} {len(step.input_ids):6d} {bucket:6d} {forward:10.3f} {sample:9.3f} {total:8.3f} "
                f"{ratio:8.2f}x {'-' if even is None else f'{100 * even:.0f}%':>22}"
            )
        print(
            "step ms: the forward and sampler graphs replayed back to back, one step at a time (no overlap); the "
            "first row (0 drafts) is the decode step the others are measured against"
        )
    finally:
        engine.shutdown()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
