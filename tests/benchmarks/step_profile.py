"""Where a decode step's time goes on CUDA: the engine's wall time per step, the GPU time of the step's graph
replayed alone (the rest is host work the GPU waited for), the step's kernels by name, and a layer's kernels in
order beside each matmul's weight-read time.

    python -m tests.benchmarks.step_profile -m synthetic:smollm2-135m --sessions 1,8,64

Wall time: a static batch of `sessions` 128-token prompts and 128 new tokens (engine/bench.py static_rate). GPU
time: that batch's decode graph replayed 100 times back to back, timed with CUDA events. Kernels: the torch
profiler over 10 replays. A layer: each kernel's time from the end of the kernel before to its own end (kernels
launched dependent start before the one before ends, so their own durations overlap) from a layer's first matmul
to the next layer's, the median over the layers (but the first two and the last two) and the replays; a matmul's
weight read is its weights' bytes over the copy rate measured before the engine loads.
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.weight_bytes import read_bytes


def replay_ms(graph: torch.cuda.CUDAGraph, n: int = 100) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def kernel_table(graph: torch.cuda.CUDAGraph, n: int = 10, rows: int = 10) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:60]].append(e.device_time_total)
    total = sum(map(sum, per_name.values())) / n
    out = [f"  {sum(map(len, per_name.values())) / n:.0f} kernels, {total:.0f} us of kernel time per step"]
    for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        out.append(f"  {len(times) / n:6.1f} x {sum(times) / len(times):6.2f} us = {sum(times) / n:7.1f} us  {name}")
    return out


def layer_table(
    graph: torch.cuda.CUDAGraph, linears: list[tuple[str, int]], bandwidth: float, n: int = 10
) -> list[str]:
    """A layer's kernels in order, from its first matmul to the next layer's (see the docstring); linears: each
    matmul's name and the bytes it reads, in the order of a layer's matmul kernels."""
    return layer_rows(*replay_ends(graph, n), linears, bandwidth)


def replay_ends(graph: torch.cuda.CUDAGraph, n: int) -> tuple[list[str], list[list[float]]]:
    """The graph replayed n times under the profiler: one replay's kernel names in order, and each replay's kernel
    end times (us)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    per = len(events) // n
    ends = [[e.time_range.end for e in events[r * per : (r + 1) * per]] for r in range(n)]
    return [e.name for e in events[:per]], ends


def layer_rows(
    names: list[str], ends: list[list[float]], linears: list[tuple[str, int]], bandwidth: float
) -> list[str]:
    """layer_table's lines from one replay's kernel names and each replay's kernel end times (us)."""
    matmul = "_qmatmul_kernel"
    first = [i for i, name in enumerate(names) if name == matmul][:: len(linears)]  # each layer's first matmul
    if len(first) < 5 or names.count(matmul) % len(linears) != 1:  # (the lm_head's the one over)
        return ["  (no layer table: the step's matmuls are not the layers' quantized linears)"]
    period = first[1] - first[0]
    layers = first[2:-2]
    out, total, matmuls = ["  a layer's kernels, us from the end of the one before to its own end:"], 0.0, iter(linears)
    for p in range(period):
        us = statistics.median(e[i + p] - e[i + p - 1] for e in ends for i in layers)
        total += us
        note = ""
        if names[first[0] + p] == matmul:
            label, nbytes = next(matmuls)
            note = f"   {label}: its weights read at the copy rate {nbytes / bandwidth * 1e6:.1f} us"
        out.append(f"  {us:7.2f}  {names[first[0] + p][:50]}{note}")
    out.append(f"  {total:7.2f}  a layer, {period} kernels")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="synthetic:smollm2-135m")
    parser.add_argument("--sessions", default="1,64")
    args = parser.parse_args()
    bandwidth = wl.copy_bandwidth(torch.device("cuda"))  # before the engine takes the memory
    bench = wl.open_engine(args.model, "cuda", EngineConfig(max_running=64, kv_tokens=100_000))
    engine = bench.engine
    layer = engine.core.model.layers[0]
    linears = [
        (name, read_bytes(w))
        for name, ws in (("qkv", layer.qkv), ("o", [layer.o]), ("mlp", layer.mlp.matrices()))
        for w in ws
    ]
    sessions = wl.Sessions(engine, False, wl.GREEDY, engine.core.model.config.vocab_size)
    try:
        for n in map(int, args.sessions.split(",")):
            rate = wl.static_rate(sessions, n, 128, 128)
            while engine.core.runner.background_pending(idle=True):  # no capture open while the profiler synchronizes
                time.sleep(0.01)
            graph = engine.core.runner.graphs.graphs[n].forward  # captured while the batch ran (its bucket in use)
            gpu = replay_ms(graph)
            print(
                f"{bench.label}, {n} sessions: {rate:,.1f} tok/s = {1e3 * n / rate:.3f} ms per step; the step's "
                f"graph alone {gpu:.3f} ms"
            )
            print("\n".join(kernel_table(graph) + layer_table(graph, linears, bandwidth)), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
