"""Tile configs of the quantized matmul at a small model's shapes (SmolLM2-135M, the default model, or
Gemma-3-4B's), against pick_config's choice, on CUDA: which tiles a launch-bound layer wants, and how far the
best is from reading the weight once at the copy bandwidth.

    python -m tests.benchmarks.small_linear_sweep [--shapes gemma3-4b]

Each config is timed as kernels_bench times kernels: one launch captured in a CUDA graph, replayed after an L2
flush (in a decode step the other layers evict a layer's weights), median of 30.
"""

import argparse
import itertools

import torch

from llamaterm.kernels.linear_triton import Config, pick_config, qmatmul_triton
from llamaterm.kernels.qweight_triton import gpu_layout
from llamaterm.kernels.triton_util import num_sms
from tests.benchmarks.kernels_bench import measure_limits, timed
from tests.support.kernel_cases import random_qweight

# name: (out features, in features, bits, group, offsets): the default model's Q4_1 blocks and Q8_0 lm_head;
# Gemma-3-4B's in 4-bit group-128 symmetric (engine/bench.py's synthetic:gemma3-4b)
SHAPES = {
    "smollm2-135m": {
        "qkv": (960, 576, 4, 32, True),
        "o": (576, 576, 4, 32, True),
        "gate_up": (3072, 576, 4, 32, True),
        "down": (576, 1536, 4, 32, True),
        "lm_head": (49152, 576, 8, 32, False),
    },
    "gemma3-4b": {
        "qkv": (4096, 2560, 4, 128, False),
        "o": (2560, 2048, 4, 128, False),
        "gate_up": (20480, 2560, 4, 128, False),
        "down": (2560, 10240, 4, 128, False),
        "lm_head": (262144, 2560, 4, 128, False),
    },
}


def candidates(m: int) -> list[Config]:
    """Tile widths, with and without a split K, at two warp counts (3 stages: the pipelining every sweep kept)."""
    block_m = 8 if m <= 8 else 16 if m <= 16 else 64
    widths, warps = ((32, 64, 128, 256), (2, 4)) if block_m == 8 else ((64, 128), (4, 8))
    return [Config(block_m, n, split, w, 3) for n, split, w in itertools.product(widths, (1, 4), warps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=SHAPES, default="smollm2-135m")
    args = parser.parse_args()
    sms = num_sms(torch.device("cuda"))
    bandwidth = measure_limits()[0]
    for name, (n, k, bits, group, offsets) in SHAPES[args.shapes].items():
        w = random_qweight(n, k, bits, group, offsets, False, device="cuda")
        layout = gpu_layout(w)
        steps = layout.values.shape[0]
        floor_us = sum(t.numel() * t.element_size() for t in layout if t is not None) / bandwidth * 1e6
        for m in (1, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            picked = pick_config(m, n, k, group, steps, sms)
            ours = timed(lambda x=x, w=w, c=picked: qmatmul_triton(x, w, c))
            tried = sorted(
                ((timed(lambda x=x, w=w, c=c: qmatmul_triton(x, w, c)), c) for c in candidates(m)), key=lambda r: r[0]
            )
            best_us, best = tried[0]
            print(
                f"{name:8s} M={m:2d}: pick_config {ours:6.2f} us {tuple(picked.__dict__.values())}, best "
                f"{best_us:6.2f} us {tuple(best.__dict__.values())} of {len(tried)}; weight read at the copy "
                f"bandwidth {floor_us:6.2f} us",
                flush=True,
            )


if __name__ == "__main__":
    main()
