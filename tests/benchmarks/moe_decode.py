"""Mixtures of experts on CUDA: decode at one and 64 sessions against the weight-read limit and llama.cpp's
published figures, a 2,048-token prefill against the bf16 matmul rate, and where a one-session step's time goes.

    python -m tests.benchmarks.moe_decode --models qwen3-30b-a3b,gpt-oss-20b

Decode: static batches of token-id prompts, greedy (engine/bench.py static_rate), the engine in this process; the
user's path (chat messages, sampled, the engine process) is `llamaterm bench -m synthetic:NAME`. Limit: the bytes a
one-session step reads (the router and the chosen experts of each layer, engine/bench.py weight_bytes) at the copy
rate measured in the same run. Prefill: a 2,048-token prompt's time to its first token against the FLOPs of the
active parameters (2 a weight a token, the lm_head for the last token only) and causal attention, at the bf16
matmul rate measured in the same run. llama.cpp: one request through its server, mid-2026 (pavlokhmel.com's
LLM throughput benchmark on 13 GPUs): gpt-oss-20b 286 tok/s on an H100 SXM, 292 on an H200; Qwen3.6-35B-A3B (Q4_K_M)
194 and 204.
"""

import argparse
import gc
import statistics
import time

import torch

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.weight_bytes import weight_bytes
from llamaterm.engine.synthetic import SYNTHETIC_PREFIX
from tests.benchmarks.step_profile import kernel_table, replay_ends, replay_ms

LLAMA_CPP = {"qwen3-30b-a3b": {"H100": 194, "H200": 204}, "gpt-oss-20b": {"H100": 286, "H200": 292}}


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a large bf16 matmul."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 10 * 2 * n**3 / (start.elapsed_time(end) / 1e3)


def prefill_flops(engine, n: int) -> float:
    c = engine.core.model.config
    lm_head = c.vocab_size * c.hidden_size
    attention = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * n * (n + 1) / 2  # q.k and p.v, causal
    return 2 * (c.active_parameters() - lm_head) * n + 2 * lm_head + attention


def layer_kernels(graph: torch.cuda.CUDAGraph, n: int = 10) -> list[str]:
    """One layer's kernels in order with the median us of each (from the end of the one before), anchored on the
    attention kernel."""
    names, ends = replay_ends(graph, n)
    anchors = [i for i, name in enumerate(names) if "attention" in name]
    if len(anchors) < 6:
        return ["  (no layer table: no attention kernel found)"]
    period, layers = anchors[1] - anchors[0], anchors[2:-2]
    out, total = [], 0.0
    for p in range(period):
        us = statistics.median(e[i + p] - e[i + p - 1] for e in ends for i in layers)
        total += us
        out.append(f"  {us:7.2f}  {names[anchors[0] + p][:70]}")
    return [*out, f"  {total:7.2f}  a layer, {period} kernels"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    parser.add_argument("--prefill", type=int, default=2048)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    card = "H200" if "H200" in gpu else "H100"
    bandwidth, flops = wl.copy_bandwidth(torch.device("cuda")), matmul_rate()
    print(f"{gpu}: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    rows = []
    for name in args.models.split(","):
        bench = wl.open_engine(SYNTHETIC_PREFIX + name, "cuda", EngineConfig(max_running=64, kv_tokens=200_000))
        engine = bench.engine
        sessions = wl.Sessions(engine, False, wl.GREEDY, engine.core.model.config.vocab_size)
        try:
            read = weight_bytes(engine.core.model)
            one = wl.static_rate(sessions, 1, 128, 256)
            # replayed while the buffers hold that one-session step (a later prefill's rows would not fit its graph),
            # once the engine's thread has captured its graphs (it captures while idle)
            while engine.core.runner.background_pending(idle=True):
                time.sleep(0.01)
            graph = engine.core.runner.graphs.graphs[1].forward
            print(f"\n{bench.label}: a one-session step's graph alone {replay_ms(graph):.3f} ms")
            print("\n".join(kernel_table(graph, rows=16)))
            print("\n".join(layer_kernels(graph)))
            many = wl.static_rate(sessions, 64, 128, 128)
            ttft = wl.ttft(sessions, args.prefill, 3)
            limit = bandwidth / read
            peer = LLAMA_CPP.get(name, {}).get(card)
            rows.append(
                f"| {engine.core.model.config.name} | {read / 1e9:.2f} GB | {one:,.0f} | {100 * one / limit:.0f}% of "
                f"{limit:,.0f} | {f'{one / peer:.2f}x {peer}' if peer else '-'} | {many:,.0f} | "
                f"{ttft * 1e3:.1f} ms | {100 * prefill_flops(engine, args.prefill) / ttft / flops:.0f}% |"
            )
        finally:
            engine.shutdown()
        del bench, engine, sessions, graph
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{gpu}")
    print(
        "| shapes | weights a step reads | tok/s, 1 session | of the weight-read limit | vs llama.cpp (published) | "
        f"tok/s, 64 sessions | TTFT, {args.prefill} tokens | of the bf16 matmul rate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
