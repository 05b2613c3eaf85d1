"""Where a CUDA graph capture's time goes, bucket by bucket, on a model of real shapes with random weights.

    python -m tests.benchmarks.capture_profile -m synthetic:llama3-8b
    python -m tests.benchmarks.capture_profile -m synthetic:smollm2-135m --buckets 1,2,4,8,16,32,64,512

For each bucket, in the order given (a fresh StepGraphs, as the engine's start-up makes it, after the model
runner's one-token warm-up):
- warm 1: the bucket's first eager step over padding (StepGraphs.warm): its Triton variants are looked up in the
  cache or compiled (`variants`, and their seconds) and their modules loaded (`loads`, seconds);
- warm 2: the same step again, every kernel loaded: the eager step's own cost;
- capture: StepGraphs.capture, split into capture_begin, the Python forward and sampler while recording, and
  capture_end (stream capture ends, the graph is instantiated), both halves summed; `mallocs`: new segments of the
  graphs' memory pool (each a cudaMalloc); `gc`: Python garbage collection during the capture;
- again: the bucket captured a second time (what a capture costs once everything it needs exists);
- replay 1 and replay 2: both graphs replayed, synchronized: the first replay uploads the graph;
- kernels: kernels one replay of the bucket's two graphs runs (torch profiler).
With --pieces, the buckets' warm-ups and captures go as the engine runs them between steps instead
(StepGraphs.background, a piece a call): each piece's host time, the slowest and which, and the pieces that took
new segments of memory (each a cudaMalloc).
Every figure is wall time with the device synchronized before and after. Then the cProfile of warm 1 and of the
capture of --profile-bucket (default: the last given), top 20 by own time; that bucket's row (marked *) carries
cProfile's overhead. Run it twice: the first run may
compile (a cold Triton cache), the second shows a warm start.
"""

import argparse
import cProfile
import gc
import io
import pstats
import time
from collections.abc import Callable
from contextlib import contextmanager
from unittest import mock

import torch
import triton.compiler.compiler as triton_compiler
import triton.runtime.jit as triton_jit
from torch.profiler import ProfilerActivity, profile

from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.model_runner import ModelRunner
from llamaterm.engine.serving.synthetic_model import parse_synthetic, synthetic_model


class Tally:
    """Seconds and counts of what the real code path calls, per bucket: names -> [calls, seconds]."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        calls, total = self.parts.get(name, [0, 0.0])
        self.parts[name] = [calls + 1, total + seconds]

    def calls(self, name: str) -> int:
        return int(self.parts.get(name, [0, 0.0])[0])

    def seconds(self, name: str) -> float:
        return self.parts.get(name, [0, 0.0])[1]

    def timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t)

        return wrapper


TALLY = Tally()


class TimedGraph(torch.cuda.CUDAGraph):
    """torch.cuda.CUDAGraph with its capture's parts timed: begin, the work recorded between, end."""

    def capture_begin(self, *args, **kwargs):
        t = time.perf_counter()
        super().capture_begin(*args, **kwargs)
        self._begun = time.perf_counter()
        TALLY.add("capture_begin", self._begun - t)

    def capture_end(self):
        t = time.perf_counter()
        TALLY.add("recording", t - self._begun)
        super().capture_end()
        TALLY.add("capture_end", time.perf_counter() - t)


@contextmanager
def instrumented():
    """Time Triton's variant lookups (disk cache or compile) and module loads, captures' parts, and the GC."""

    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            TALLY.add(f"gc gen{info['generation']}", time.perf_counter() - started[0])

    jit, kernel = triton_jit.JITFunction, triton_compiler.CompiledKernel
    gc.callbacks.append(on_gc)
    try:
        with (
            mock.patch.object(jit, "_do_compile", TALLY.timed("variants", jit._do_compile)),
            mock.patch.object(kernel, "_init_handles", TALLY.timed("loads", kernel._init_handles)),
            mock.patch.object(torch.cuda, "CUDAGraph", TimedGraph),
        ):
            yield
    finally:
        gc.callbacks.remove(on_gc)


def synced(
    device: torch.device, fn: Callable[[], object], profile_as: str | None = None, profiles: list[str] | None = None
) -> float:
    """fn's seconds, the device synchronized before and after; with profile_as, its cProfile joins `profiles`."""
    torch.cuda.synchronize(device)
    prof = cProfile.Profile() if profile_as else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    fn()
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t
    if prof and profiles is not None and profile_as:
        prof.disable()
        profiles.append(top(prof, profile_as))
    return seconds


def kernels_per_replay(graphs: StepGraphs, bucket: int) -> int:
    g = graphs.graphs[bucket]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.forward.replay()
        g.sample.replay()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def segments(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("segment.all.allocated", 0)


def top(prof: cProfile.Profile, title: str, rows: int = 20) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    body = out.getvalue()
    return f"--- {title}: top {rows} by own time\n" + body[body.find("   ncalls") :]


def ms(x: float) -> str:
    return f"{1e3 * x:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "-m", "--model", default="synthetic:llama3-8b", help="synthetic:NAME (engine/serving/synthetic_model.py)"
    )
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--buckets", default="", help="comma-separated; default: the decode buckets, 1 upward")
    parser.add_argument("--profile-bucket", type=int, default=0, help="default: the last of --buckets")
    parser.add_argument("--pieces", action="store_true", help="time the engine's background pieces instead")
    args = parser.parse_args()

    device = torch.device("cuda")
    name, quantized = parse_synthetic(args.model)
    t = time.perf_counter()
    model = synthetic_model(name, quantized, device)
    torch.cuda.synchronize(device)
    made = time.perf_counter() - t
    block_size, num_blocks = 16, 4096  # the pool's size does not change what a step launches
    runner = ModelRunner(model, num_blocks, block_size, args.max_running, args.max_batch_tokens, cuda_graphs=False)
    max_blocks = -(-model.config.context_length // block_size)
    t = time.perf_counter()
    graphs = StepGraphs(runner._forward, runner._sample, device, args.max_running, args.max_batch_tokens, max_blocks)
    buffers = time.perf_counter() - t
    print(
        f"{model.config.name}, {len(model.layers)} layers; random weights {made:.2f} s, KV cache "
        f"{runner.startup_s['KV cache']:.2f} s, one-token warm-up {runner.startup_s['warm-up']:.2f} s, graph "
        f"buffers {buffers:.3f} s; {len(gc.get_objects()):,} Python objects tracked by the GC",
        flush=True,
    )
    buckets = [int(b) for b in args.buckets.split(",") if b] or [b for b in graphs.buckets if b <= args.max_running]
    unknown = [b for b in buckets if b not in graphs.buckets]
    if unknown:
        raise SystemExit(f"not buckets: {unknown}; the buckets are {graphs.buckets}")
    if args.pieces:
        return pieces(graphs, buckets, device)
    profiled = args.profile_bucket or buckets[-1]
    print(
        "bucket   warm 1  variants (s)  loads (s)   warm 2    begin  record    end  capture  mallocs   gc ms"
        "    again  replay 1  replay 2  kernels"
    )
    print("            ms                               ms       ms      ms     ms       ms                      ms")
    profiles: list[str] = []
    with instrumented():
        for bucket in buckets:
            TALLY.parts.clear()
            profile_as = f"of bucket {bucket}" if bucket == profiled else None
            warm1 = synced(device, lambda b=bucket: graphs.warm(b), profile_as and "warm 1 " + profile_as, profiles)
            found = (TALLY.calls("variants"), TALLY.seconds("variants"), TALLY.calls("loads"), TALLY.seconds("loads"))
            warm2 = synced(device, lambda b=bucket: graphs.warm(b))
            TALLY.parts.clear()
            before = segments(device)
            capture = synced(
                device, lambda b=bucket: graphs.capture(b), profile_as and "capture " + profile_as, profiles
            )
            mallocs = segments(device) - before
            parts = [TALLY.seconds(part) for part in ("capture_begin", "recording", "capture_end")]
            collected = sum(v[1] for k, v in TALLY.parts.items() if k.startswith("gc"))
            again = synced(device, lambda b=bucket: graphs.capture(b))
            g = graphs.graphs[bucket]
            replay = lambda g=g: (g.forward.replay(), g.sample.replay())
            replay1, replay2 = synced(device, replay), synced(device, replay)
            print(
                f"{bucket:5d}{'*' if bucket == profiled else ' '}"
                f" {ms(warm1)} {found[0]:4d} {found[1]:7.3f} {found[2]:4d} {found[3]:6.3f} {ms(warm2)}"
                f" {ms(parts[0])}{ms(parts[1])}{ms(parts[2])} {ms(capture)} {mallocs:6d} {ms(collected)}"
                f" {ms(again)}  {ms(replay1)}  {ms(replay2)}  {kernels_per_replay(graphs, bucket):6d}",
                flush=True,
            )
    print("\n".join(profiles))


def pieces(graphs: StepGraphs, buckets: list[int], device: torch.device) -> None:
    """Each bucket warmed and captured as the engine's loop does it beside live steps, a piece a call of
    StepGraphs.background; per job, its pieces' host times."""
    print("bucket  job       pieces  first pieces ms          slowest ms (piece)  median ms  new segments (piece)")
    for bucket in buckets:
        graphs.uses[bucket] = 1 << 20  # the most wanted
        for job in ("warm-up", "capture"):
            times, grown = [], []
            while True:
                before, t = segments(device), time.perf_counter()
                waiting = graphs.background(0.0, idle=False)
                times.append(time.perf_counter() - t)
                if segments(device) > before:
                    grown.append(f"{segments(device) - before} ({len(times)})")
                if waiting:
                    times.pop()  # a look at the instantiating thread, not a piece of work
                    time.sleep(0.0005)
                elif graphs._job is None:
                    break
            slowest = max(range(len(times)), key=times.__getitem__)
            print(
                f"{bucket:6d}  {job:8s} {len(times):7d}  {' '.join(ms(x).strip() for x in times[:4]):22s}"
                f"  {ms(times[slowest])} ({slowest + 1:3d})  {ms(sorted(times)[len(times) // 2])}   {' '.join(grown)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
