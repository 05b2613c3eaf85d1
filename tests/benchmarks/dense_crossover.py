"""Where a kept dense copy beats the fused 4-bit kernel: each of a layer's matmuls at M rows, our kernel (its own
pick_config tiles) beside fp16 cuBLAS on the dequantized weight, on CUDA. kernels/linear_triton.py's DENSE_M_KEPT
and DENSE_M_KEPT_SMALL come from this table.

    python -m tests.benchmarks.dense_crossover [--shapes smollm2-135m llama3-8b]

Each call is timed as kernels_bench times kernels: one launch captured in a CUDA graph, replayed after an L2 flush,
median of 30. In a decode step our kernels also launch dependent on the kernel before, which these times leave out.
"""

import argparse

import torch
import torch.nn.functional as F

from llamaterm.kernels.linear_triton import pick_config, qmatmul_triton
from llamaterm.kernels.qweight_triton import gpu_layout
from llamaterm.kernels.triton_util import num_sms
from tests.benchmarks.kernels_bench import timed
from tests.benchmarks.small_linear_sweep import SHAPES
from tests.support.kernel_cases import random_qweight

# Llama-3-8B's blocks in 4-bit group-128 symmetric (engine/bench.py's synthetic:llama3-8b)
SHAPES_8B = {
    "qkv": (6144, 4096, 4, 128, False),
    "o": (4096, 4096, 4, 128, False),
    "gate_up": (28672, 4096, 4, 128, False),
    "down": (4096, 14336, 4, 128, False),
}
ROWS = (1, 8, 16, 32, 48, 64, 96, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama3-8b"])
    args = parser.parse_args()
    for model in args.shapes:
        shapes = SHAPES_8B if model == "llama3-8b" else SHAPES[model]
        print(f"\n{model}: us, ours / cuBLAS on the dense copy, by rows")
        print(f"{'':8}" + "".join(f"{m:>14}" for m in ROWS))
        layer = [[0.0, 0.0] for _ in ROWS]
        for name, (n, k, bits, group, offsets) in shapes.items():
            if name == "lm_head":  # never kept dense (engine/serving/model.py keep_dense_weights)
                continue
            w = random_qweight(n, k, bits, group, offsets, False, device="cuda")
            dense = w.dense(torch.float16)
            steps = gpu_layout(w).values.shape[0]
            cells = []
            for i, m in enumerate(ROWS):
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                tiles = pick_config(m, n, k, group, steps, num_sms(x.device))  # (a config given: never cuBLAS)
                ours = timed(lambda x=x, w=w, tiles=tiles: qmatmul_triton(x, w, tiles))
                cublas = timed(lambda x=x, dense=dense: F.linear(x, dense))
                layer[i][0] += ours
                layer[i][1] += cublas
                cells.append(f"{ours:6.1f}/{cublas:6.1f}")
            print(f"{name:8}" + "".join(f"{c:>14}" for c in cells), flush=True)
        print(f"{'layer':8}" + "".join(f"{a:6.1f}/{b:6.1f}".rjust(14) for a, b in layer))


if __name__ == "__main__":
    main()
