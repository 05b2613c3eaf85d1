"""Decode speed per byte of weights read, across model families, on CUDA: does a family's architecture cost
anything beyond its bytes? Static batches (engine/bench.py static_rate) of random 4-bit weights in real shapes,
beside a control: Gemma-3-4B's dims as a plain Llama (no q/k or post norms, SiLU, one RoPE), the same bytes.

    python -m tests.benchmarks.per_byte --models llama3-8b,qwen2.5-7b,gemma3-4b,gemma-dims-as-llama,gemma3-12b

Limit: the weight bytes of a step at the copy bandwidth of the same run (engine/bench.py copy_bandwidth).
"""

import argparse

import torch

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.synthetic_model import SYNTHETIC
from llamaterm.engine.serving.weight_bytes import weight_bytes
from llamaterm.engine.synthetic import SYNTHETIC_PREFIX
from tests.benchmarks.step_profile import kernel_table, replay_ms

CONTROL = "gemma-dims-as-llama"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=f"llama3-8b,qwen2.5-7b,gemma3-4b,{CONTROL},gemma3-12b")
    args = parser.parse_args()
    SYNTHETIC[CONTROL] = (
        wl._llama("Gemma-3-4B dims as Llama", 34, 2560, 10240, 8, 4, 262144, 131072, 1e6, head_dim=256, tied=True),
        SYNTHETIC["gemma3-4b"][1],
    )
    bandwidth = wl.copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(
        "| shapes | weights per step | tok/s, 1 session | GB/s, 1 session | % of the copy bandwidth | "
        "its graph alone | kernels per step | tok/s, 64 sessions |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        bench = wl.open_engine(SYNTHETIC_PREFIX + name, "cuda", EngineConfig(max_running=64, kv_tokens=100_000))
        engine = bench.engine
        sessions = wl.Sessions(engine, False, wl.GREEDY, engine.core.model.config.vocab_size)
        try:
            gb = weight_bytes(engine.core.model) / 1e9
            one = wl.static_rate(sessions, 1, 128, 128)
            many = wl.static_rate(sessions, 64, 128, 128)
            graph = engine.core.runner.graphs.graphs[1].forward
            kernels = kernel_table(graph, rows=0)[0].split()[0]
            print(
                f"| {engine.core.model.config.name} | {gb:.3f} GB | {one:,.1f} | {gb * one:,.0f} | "
                f"{100 * gb * one * 1e9 / bandwidth:.0f}% | {replay_ms(graph):.3f} ms | {kernels} | {many:,.1f} |",
                flush=True,
            )
        finally:
            engine.shutdown()
        del bench, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
