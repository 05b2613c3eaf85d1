"""Where a decode step's time goes on CUDA: the engine's wall time per step, the GPU time of the step's graph
replayed alone (the rest is host work the GPU waited for), and the step's kernels by name.

    python -m tests.benchmarks.step_profile -m synthetic:smollm2-135m --sessions 1,8,64

Wall time: a static batch of `sessions` 128-token prompts and 128 new tokens (engine/bench.py static_rate). GPU
time: that batch's decode graph replayed 100 times back to back, timed with CUDA events. Kernels: the torch
profiler over 10 replays.
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="synthetic:smollm2-135m")
    parser.add_argument("--sessions", default="1,64")
    args = parser.parse_args()
    bench = wl.open_engine(args.model, "cuda", EngineConfig(max_running=64, kv_tokens=100_000))
    engine = bench.engine
    sessions = wl.Sessions(engine, False, wl.GREEDY, engine.model.config.vocab_size)
    try:
        for n in map(int, args.sessions.split(",")):
            rate = wl.static_rate(sessions, n, 128, 128)
            while engine.runner.background_pending(idle=True):  # no capture open while the profiler synchronizes
                time.sleep(0.01)
            graph = engine.runner.graphs.graphs[n].forward  # captured while the batch ran (its bucket in use)
            gpu = replay_ms(graph)
            print(
                f"{bench.label}, {n} sessions: {rate:,.1f} tok/s = {1e3 * n / rate:.3f} ms per step; the step's "
                f"graph alone {gpu:.3f} ms"
            )
            print("\n".join(kernel_table(graph)), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
