"""Where a step's time goes on CUDA, seen from the GPU: each graphed step's forward pass and sampler timed with CUDA
events, by token bucket, and the GPU's idle time between them (the host's work the GPU waited for), for a static
batch of chat messages sampled with every filter on, free and under a JSON schema, through the engine in this
process.

    python -m tests.benchmarks.step_trace --sessions 64 --json-schema tests/benchmarks/people.schema.json

A step under a grammar samples only once its masks are filled (engine/serving/model_runner.py): idle time there is
the chain of the last step's tokens to the host, the grammars advanced, the masks filled and the sampler queued.
The figures are the middle half of the run's steps (every session decoding), medians but the idle time, a mean.
"""

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.workload import FILTERS

Span = tuple[str, int, torch.cuda.Event, torch.cuda.Event]  # forward or sampler, its bucket, its start and end


@contextmanager
def traced():
    """StepGraphs' forward passes and samplers, each between two CUDA events, listed in launch order."""
    spans: list[Span] = []
    forward, sample = StepGraphs.run_forward, StepGraphs.run_sample

    def timed(kind, run):
        def wrapper(self, bucket, *args):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(self, bucket, *args)
            end.record()
            spans.append((kind, bucket, start, end))
            return out

        return wrapper

    StepGraphs.run_forward, StepGraphs.run_sample = timed("forward", forward), timed("sampler", sample)
    try:
        yield spans
    finally:
        StepGraphs.run_forward, StepGraphs.run_sample = forward, sample


def run(engine: Engine, sessions: int, tokens: int, grammar: Grammar | None) -> tuple[int, float]:
    handles = []
    for i in range(sessions):
        ask = f"List some people who work at company number {i}, with their skills and cities, in detail."
        prompt = engine.encode_prompt([{"role": "user", "content": ask}])
        params = SamplingParams(max_tokens=tokens, seed=i, grammar=grammar, **FILTERS)
        handles.append(engine.submit(None, params, prompt_ids=prompt))
    start = time.perf_counter()
    n = sum(len(event.token_ids) for h in handles for event in h.events())
    return n, time.perf_counter() - start


def report(name: str, n: int, seconds: float, steps: int, spans: list[Span]) -> None:
    torch.cuda.synchronize()
    middle = spans[len(spans) // 4 : 3 * len(spans) // 4]
    times = defaultdict(list)
    for kind, bucket, start, end in middle:
        times[kind, bucket].append(start.elapsed_time(end))
    idle = sum(a[3].elapsed_time(b[2]) for a, b in zip(middle, middle[1:], strict=False))
    forwards = sum(kind == "forward" for kind, *_ in middle)
    parts = ", ".join(
        f"{kind} at {bucket} tokens {statistics.median(ms):.3f} ms (x{len(ms)})"
        for (kind, bucket), ms in sorted(times.items())
    )
    print(
        f"{name}: {n / seconds:,.0f} tok/s, {steps} steps of {1e3 * seconds / steps:.3f} ms, {n / steps:.1f} tokens a "
        f"step; the middle half: {parts}; the GPU idle {idle / max(forwards, 1):.3f} ms a step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--json-schema", default="tests/benchmarks/people.schema.json")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    schema = Grammar("json_schema", open(args.json_schema).read())
    with Engine.from_model(EngineConfig(model=args.model, device="cuda", speculate="off")) as engine:
        for grammar in (None, schema):  # compiles the grammar and captures the graphs these steps use
            run(engine, args.sessions, 96, grammar)
        time.sleep(5)  # the graphs of the other step sizes, captured while the engine idles
        for _ in range(args.rounds):
            for name, grammar in (("free", None), ("schema", schema)):
                first = engine.step_stats().steps
                with traced() as spans:
                    n, seconds = run(engine, args.sessions, args.tokens, grammar)
                report(name, n, seconds, engine.step_stats().steps - first, spans)


if __name__ == "__main__":
    main()
