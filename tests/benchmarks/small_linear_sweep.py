"""Tile configs of the quantized matmul at a small model's shapes (SmolLM2-135M, the default model), against
pick_config's choice, on CUDA: which tiles a launch-bound layer wants.

    python -m tests.benchmarks.small_linear_sweep

Each config is timed as kernels_bench times kernels: one launch captured in a CUDA graph, replayed after an L2
flush (in a decode step the other layers evict a layer's weights), median of 30.
"""

import itertools

import torch

from llamaterm.kernels.linear_triton import Config, pick_config, qmatmul_triton
from llamaterm.kernels.qweight_triton import gpu_layout
from llamaterm.kernels.triton_util import num_sms
from tests.benchmarks.kernels_bench import timed
from tests.kernel_cases import random_qweight

# name: (out features, in features, bits, group, offsets), as the default model's Q4_1 blocks and Q8_0 lm_head
SHAPES = {"qkv": (960, 576, 4, 32, True), "o": (576, 576, 4, 32, True), "gate_up": (3072, 576, 4, 32, True),
          "down": (576, 1536, 4, 32, True), "lm_head": (49152, 576, 8, 32, False)}


def candidates(m: int) -> list[Config]:
    """Tile widths, with and without a split K, at two warp counts (3 stages: the pipelining every sweep kept)."""
    block_m = 8 if m <= 8 else 16 if m <= 16 else 64
    widths, warps = ((32, 64, 128, 256), (2, 4)) if block_m == 8 else ((64, 128), (4, 8))
    return [Config(block_m, n, split, w, 3) for n, split, w in itertools.product(widths, (1, 4), warps)]


def main() -> None:
    sms = num_sms(torch.device("cuda"))
    for name, (n, k, bits, group, offsets) in SHAPES.items():
        w = random_qweight(n, k, bits, group, offsets, False, device="cuda")
        steps = gpu_layout(w).values.shape[0]
        for m in (1, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            picked = pick_config(m, n, k, group, steps, sms)
            ours = timed(lambda x=x, w=w, c=picked: qmatmul_triton(x, w, c))
            tried = sorted(((timed(lambda x=x, w=w, c=c: qmatmul_triton(x, w, c)), c) for c in candidates(m)),
                           key=lambda r: r[0])
            best_us, best = tried[0]
            print(f"{name:8s} M={m:2d}: pick_config {ours:6.2f} us {tuple(picked.__dict__.values())}, best "
                  f"{best_us:6.2f} us {tuple(best.__dict__.values())} of {len(tried)}", flush=True)


if __name__ == "__main__":
    main()
