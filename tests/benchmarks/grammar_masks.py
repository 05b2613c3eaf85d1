"""What a step's grammar masks cost the host, by llguidance's pool size, on replies a model writes.

The model (the default one unless -m) writes --replies replies (a row each) under a JSON schema, sampled as
`llamaterm bench` samples (engine/workload.py's FILTERS); then the masks of --rows sequences (the replies in turn)
are filled a step at a time along those replies' tokens, as the engine fills them (grammar.fill_bitmasks), with
llguidance's pool of 1, 2, 4, 8 and 12 threads, and one row after another on this thread. A random walk through the
same schema (each token drawn uniformly among those the mask allows, what random weights write) is the second row.
Then the engine's own fill (one thread) alone and beside a thread that runs Python all the while, as the engine's
thread does: with llguidance's own copy of the tokenizer (grammar.native_tokenizer), and with the Python reader,
whose every call from a mask waits for the GIL. Last, the forced runs a step finds on the engine's thread
(GrammarMatcher.fast_forward: the vocabulary keeps the runs by their text), beside llguidance computing each.

    python -m tests.benchmarks.grammar_masks --device cuda
"""

import argparse
import statistics
import sys
import threading
import time
from unittest import mock

import llguidance
import numpy as np
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving import grammar
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.model_runner import MASK_SWITCH_S
from llamaterm.engine.serving.sequence import FORCED_MOST
from llamaterm.engine.workload import FILTERS

SCHEMA = "tests/benchmarks/people.schema.json"
PROMPTS = [
    "List some people who work at a small startup.",
    "Describe the team of a research lab.",
    "Who works at the bakery on the corner?",
    "Give me a list of employees of a newspaper.",
]


def model_replies(engine: Engine, schema: Grammar, n: int, tokens: int) -> list[list[int]]:
    handles = []
    for i in range(n):
        prompt = engine.encode_prompt([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        params = SamplingParams(max_tokens=tokens, seed=i, grammar=schema, **FILTERS)
        handles.append(engine.submit(None, params, prompt_ids=prompt))
    return [[t for event in h.events() for t in event.token_ids] for h in handles]


def random_walks(vocabulary: grammar.Vocabulary, schema: Grammar, n: int, tokens: int) -> list[list[int]]:
    walks = []
    for seed in range(n):
        rng, matcher = np.random.default_rng(seed), vocabulary.matcher(schema)
        bitmask, walk = torch.zeros(1, vocabulary.words, dtype=torch.int32), []
        for _ in range(tokens):
            grammar.fill_bitmasks([matcher], bitmask)
            allowed = np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little"))
            walk.append(int(rng.choice(allowed[allowed < vocabulary.size])))
            assert matcher.accept(walk[-1])
        walks.append(walk)
    return walks


def step_ms(vocabulary: grammar.Vocabulary, schema: Grammar, replies: list[list[int]], rows: int, fill) -> float:
    """The median time of a step's masks, `rows` sequences along the replies in turn."""
    streams = [replies[i % len(replies)] for i in range(rows)]
    matchers = [vocabulary.matcher(schema) for _ in streams]
    bitmask = torch.zeros(rows, vocabulary.words, dtype=torch.int32)
    times = []
    for i in range(min(len(s) for s in streams) - 1):
        t = time.perf_counter()
        fill(matchers, bitmask)
        times.append(time.perf_counter() - t)
        for matcher, stream in zip(matchers, streams, strict=True):
            matcher.accept(stream[i])
    return 1e3 * statistics.median(times)


def runs_ms(vocabulary: grammar.Vocabulary, schema: Grammar, replies: list[list[int]], rows: int, take) -> float:
    """The mean time a step of `rows` sequences along the replies takes to find their forced runs (take(matcher):
    the run it takes), each sequence past its next token first."""
    streams = [replies[i % len(replies)] for i in range(rows)]
    matchers = [vocabulary.matcher(schema) for _ in streams]
    at, spent, steps = [0] * rows, 0.0, 0
    while all(i < len(s) - FORCED_MOST for i, s in zip(at, streams, strict=True)):
        for row, matcher in enumerate(matchers):
            matcher.accept(streams[row][at[row]])
            at[row] += 1
        t = time.perf_counter()
        runs = [take(matcher) for matcher in matchers]
        spent, steps = spent + time.perf_counter() - t, steps + 1
        at = [i + len(run) for i, run in zip(at, runs, strict=True)]
    return 1e3 * spent / steps


def computed_each_time(matcher: grammar.GrammarMatcher) -> list[int]:
    """fast_forward as llguidance gives it, the forced text tokenized each time."""
    m = matcher._matcher
    run = m.compute_ff_tokens()[:FORCED_MOST]
    if m.try_consume_tokens(run) < len(run) or (run and m.is_stopped()):
        raise AssertionError("the replies end in a forced run: give them more tokens")
    return run


def one_by_one(matchers: list[grammar.GrammarMatcher], bitmask: torch.Tensor) -> None:
    row_bytes = bitmask.shape[1] * 4
    for row, m in enumerate(matchers):
        m._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)


def beside_busy_thread(work):
    """work() while another thread runs Python the whole time (the engine's thread, host-bound)."""
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    busy.start()
    try:
        return work()
    finally:
        stop.set()
        busy.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--replies", type=int, default=64)  # a reply a row: no two rows share a state
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    schema = Grammar("json_schema", open(SCHEMA).read())
    with Engine.from_model(EngineConfig(model=args.model, device=args.device, speculate="off")) as engine:
        vocabulary = engine._vocabulary()
        with mock.patch.object(grammar, "native_tokenizer", lambda *_: None):
            python_reader = grammar.Vocabulary(engine.tokenizer, vocabulary.size)
        kinds = {
            "the model's replies": model_replies(engine, schema, args.replies, args.tokens),
            "random walks": random_walks(vocabulary, schema, args.replies, args.tokens),
        }
    sizes = [1, 2, 4, 8, 12]
    print(f"{engine.model_name}: ms a step for the masks of {args.rows} rows under {SCHEMA}, by llguidance's threads")
    print(f"{'replies':20} " + " ".join(f"{n:>6}" for n in sizes) + "  one by one")
    for kind, replies in kinds.items():
        cells = []
        for n in sizes:
            executor = llguidance.LLExecutor(n)
            fill = lambda ms, bm, ex=executor: ex.unsafe_compute_mask_ptr(
                [(m._matcher, r) for r, m in enumerate(ms)], bm.data_ptr(), bm.shape[1] * 4, bm.shape[0]
            )
            cells.append(step_ms(vocabulary, schema, replies, args.rows, fill))
        serial = step_ms(vocabulary, schema, replies, args.rows, one_by_one)
        print(f"{kind:20} " + " ".join(f"{c:6.2f}" for c in cells) + f"  {serial:10.2f}")
    sys.setswitchinterval(MASK_SWITCH_S)  # as the engine sets it while its masks' thread starts
    replies = kinds["the model's replies"]
    print(f"\nthe model's replies, the engine's fill (one thread){'alone':>12} {'beside a busy thread':>21}")
    for name, vocab in (("llguidance's tokenizer", vocabulary), ("the Python reader", python_reader)):
        alone = step_ms(vocab, schema, replies, args.rows, grammar.fill_bitmasks)
        beside = beside_busy_thread(lambda v=vocab: step_ms(v, schema, replies, args.rows, grammar.fill_bitmasks))
        print(f"{name:51}{alone:6.2f} {beside:21.2f}")
    print(f"\nthe model's replies, ms a step for the forced runs of {args.rows} rows on the engine's thread")
    for name, take in (
        ("kept by their text (fast_forward)", lambda m: m.fast_forward(FORCED_MOST)),
        ("computed each time (compute_ff_tokens)", computed_each_time),
    ):
        print(f"{name:51}{runs_ms(vocabulary, schema, replies, args.rows, take):6.3f}")


if __name__ == "__main__":
    main()
