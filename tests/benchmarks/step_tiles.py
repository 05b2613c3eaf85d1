"""Which tiles a decode step's quantized matmuls want, timed inside the step's own CUDA graph: kernels launched
dependent there overlap their neighbours' starts and tails, which timing a kernel alone (kernels_bench --sweep)
cannot show.

    python -m tests.benchmarks.step_tiles -m synthetic:llama3-8b --sessions 1 --context 256

For each of a layer's matmul shapes in turn (the lm_head's too), each candidate tile config replaces pick_config's
for that shape alone; the decode step's forward graph is captured again and replayed (100 times, CUDA events).
Candidates: pick_config's; K unsplit with 16-, 32- and 64-row tiles and 4-8 pipeline stages (no partials to reduce:
a deep pipeline keeps the bytes in flight instead); K split 2, 4 or 8 ways with 64-row tiles. Last, every shape at
its best together. A config that does not compile (shared memory) is skipped.
"""

import argparse
from collections.abc import Iterator
from dataclasses import astuple

import torch

from llamaterm.kernels import linear_triton
from llamaterm.kernels.linear_triton import Config
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import gpu_layout
from llamaterm.kernels.triton_util import num_sms
from tests.benchmarks.step_profile import replay_ms
from tests.benchmarks.verify_step import decode_engine, verify_step

Shape = tuple[int, int]  # a matmul's (N, K)


def candidates(default: Config, steps: int) -> list[Config]:
    """See the docstring; `steps` of K (a split takes two at least)."""
    out = [default]
    for block_n in (16, 32, 64):
        for stages in (4, 6, 8):
            out.append(Config(default.block_m, block_n, 1, 4 if block_n >= 64 else 2, stages))
    for split in (2, 4, 8):
        if split <= steps // 2:
            for stages in (3, 4):
                out.append(Config(default.block_m, 64, split, 4, stages))
    return list(dict.fromkeys(out))


class Sweep:
    """The engine's decode graph for one step, captured again under per-shape tile overrides."""

    def __init__(self, engine, step):
        self.engine, self.step = engine, step
        self.overrides: dict[Shape, Config] = {}
        self.chosen: dict[Shape, Config] = {}  # what pick_config gave each shape (recorded on the first capture)
        original = linear_triton.pick_config

        def pick(m: int, n: int, k: int, group: int, steps: int, sms: int) -> Config:
            cfg = self.overrides.get((n, k)) or original(m, n, k, group, steps, sms)
            self.chosen.setdefault((n, k), cfg)
            return cfg

        linear_triton.pick_config = pick

    def graph_ms(self, overrides: dict[Shape, Config]) -> float | None:
        """The forward graph's replay time under `overrides`; None if a config failed to compile or run."""
        self.overrides = overrides
        graphs = self.engine.core.runner.graphs
        bucket, _ = graphs.prepare(self.step)
        graphs.graphs.pop(bucket, None)
        try:
            graphs.warm(bucket)  # compiles the new variants outside the capture
            graphs.capture(bucket)
        except Exception as e:  # noqa: BLE001 - report and go on: the rest of the sweep still tells
            print(f"    skipped {[astuple(c) for c in overrides.values()]}: {type(e).__name__}: {str(e)[:80]}")
            torch.cuda.synchronize()
            return None
        graphs.prepare(self.step)  # the step's metadata in the buffers the graph reads
        return replay_ms(graphs.graphs[bucket].forward, 100)


def shapes(model) -> Iterator[tuple[str, Shape, int]]:
    """(name, (N, K), steps of K) of a layer's quantized matmuls and the lm_head."""
    layer = model.layers[0]
    mlp = layer.mlp  # a dense layer's (GatedMLP)
    named = [("qkv", w) for w in layer.qkv] + [("o", layer.o)] + [("gate_up", w) for w in mlp.gate_up]
    named += [("down", mlp.down), ("lm_head", model.lm_head)]
    for name, w in named:
        if isinstance(w, QuantWeight):
            yield name, (w.shape[0], w.shape[1]), gpu_layout(w).values.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="synthetic:llama3-8b")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    bench = decode_engine(args.model, args.sessions, args.context)
    try:
        engine = bench.engine
        step = verify_step(args.sessions, 0, args.context, engine.core.block_manager.block_size)
        sweep = Sweep(engine, step)
        base = sweep.graph_ms({})
        assert base is not None
        print(
            f"{bench.label}: {args.sessions} session(s), {args.context} tokens of context; decode graph {base:.3f} ms"
        )
        print("config: (block_m, block_n, split_k, num_warps, num_stages)")
        best: dict[Shape, Config] = {}
        for name, shape, steps in shapes(engine.core.model):
            default = sweep.chosen[shape]
            timed = []
            for cfg in candidates(default, steps):
                ms = sweep.graph_ms({shape: cfg})
                if ms is not None:
                    timed.append((ms, cfg))
            timed.sort(key=lambda t: t[0])
            mine = next(ms for ms, cfg in timed if cfg == default)
            best[shape] = timed[0][1]
            print(
                f"  {name} {shape}: pick_config {astuple(default)} {mine:.3f} ms; best "
                + ", ".join(f"{astuple(cfg)} {ms:.3f}" for ms, cfg in timed[:3])
            )
        together = sweep.graph_ms(best)
        print(f"every shape at its best: {together} ms against {base:.3f} ({num_sms(torch.device('cuda'))} SMs)")
    finally:
        bench.engine.shutdown()


if __name__ == "__main__":
    main()
