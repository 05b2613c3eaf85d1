"""One MoE layer on CUDA (kernels/moe_triton.py: routing, align and the two grouped launches) beside a bf16 torch
peer and the device's limits, measured in the same run.

    python -m tests.benchmarks.moe_bench                              # both layers, every M
    python -m tests.benchmarks.moe_bench --model qwen3 --m 1 8 --sweep  # also time candidate tile configs

Layers: Qwen3-30B-A3B's (128 experts, top-8, H 2048, I 768; gate_up 4-bit group 32 with offsets as Q4_K gives,
down 8-bit group 16 as Q6_K's values) and gpt-oss-20b's (32 experts, top-4, H = I = 2880; MXFP4 experts with
biases, the clamped SwiGLU), random codes, a fresh draw of router logits per M.
Timing: kernels_bench.timed: the layer captured in a CUDA graph, replayed after an L2 flush, the median.
Bytes: the GPU-layout bytes (codes, scales, offsets) of the distinct experts the step chose, each read once; GB/s
and % of the device-to-device copy rate (read + write, kernels_bench.measure_limits). FLOPs: 6 P H I for P = M k
pairs. Limit: max(bytes / copy rate, FLOPs / bf16 matmul rate).
Peer: the same layer in bf16 torch on dense copies of the experts: torch.topk routing, the pairs sorted by expert,
torch._grouped_mm for gate_up and down, the activation's reference, the weighted sum by index_add_ (a CUDA graph
too); without _grouped_mm (torch < 2.8, or before Hopper), moe_ref's loop over the chosen experts (eager: it
syncs).
"""

import argparse
import itertools

import torch

from llamaterm.kernels.activation import REFERENCES
from llamaterm.kernels.moe import Experts, moe_ref, route, route_ref
from llamaterm.kernels.moe_triton import MoeConfig, moe_triton, pick_config
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import gpu_layout
from tests.benchmarks.kernels_bench import said_limits, timed
from tests.support.kernel_cases import moe_layer

MODELS = ["qwen3", "gpt-oss"]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 256, 2048]


def expert_bytes(experts: Experts) -> float:
    """GPU-layout bytes of one expert's weights (the stacks' bytes over E; their row padding is negligible)."""
    total = 0
    for w in [*experts.gate_up, experts.down]:
        if isinstance(w, QuantWeight):
            total += sum(t.numel() * t.element_size() for t in gpu_layout(w) if t is not None)
        else:
            total += w.numel() * w.element_size()
    return total / experts.n_experts


def dense_bf16(experts: Experts) -> Experts:
    as_bf16 = lambda w: w.dequantize(torch.bfloat16) if isinstance(w, QuantWeight) else w.bfloat16()  # noqa: E731
    return Experts(
        experts.n_experts,
        [torch.cat([as_bf16(w).view(experts.n_experts, -1, w.shape[1]) for w in experts.gate_up], 1).flatten(0, 1)],
        as_bf16(experts.down),
        experts.activation,
        experts.gate_up_bias,
        experts.down_bias,
    )


def grouped_mm_peer(dense: Experts, top_k: int):
    """The layer in bf16 torch with torch._grouped_mm (no host sync): x [M, H], logits [M, E] -> [M, H]."""
    e = dense.n_experts
    w1 = dense.gate_up[0].view(e, -1, dense.gate_up[0].shape[1]).transpose(1, 2)  # [E, H, 2I]
    w2 = dense.down.view(e, -1, dense.down.shape[1]).transpose(1, 2)  # [E, I, H]
    act = REFERENCES[dense.activation]

    def layer(x, logits):
        weights, ids = route_ref(logits, top_k, True)
        flat = ids.flatten().long()
        order = torch.argsort(flat, stable=True)
        rows, expert = order // top_k, flat[order]
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(ids).flatten()
        )
        offs = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(x[rows], w1, offs=offs)
        if dense.gate_up_bias is not None:
            gate_up = gate_up + dense.gate_up_bias[expert].to(gate_up.dtype)
        y = torch._grouped_mm(act(gate_up), w2, offs=offs)
        if dense.down_bias is not None:
            y = y + dense.down_bias[expert].to(y.dtype)
        y = y.float() * weights.flatten()[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, y).to(x.dtype)

    return layer


def peer_us(dense: Experts, top_k: int, x: torch.Tensor, logits: torch.Tensor) -> tuple[float, str]:
    if hasattr(torch, "_grouped_mm"):
        layer = grouped_mm_peer(dense, top_k)
        try:
            return timed(lambda: layer(x, logits)), "grouped_mm"
        except RuntimeError as e:  # a build or device without it: say so, take the loop
            print(f"torch._grouped_mm unavailable here ({str(e).splitlines()[0]}): the peer is a loop")
    return timed(lambda: moe_ref(x, *route_ref(logits, top_k, True), dense), graph=False), "loop"


def layer_rows(model: str, batches: list[int], bw: float, peak: float, sweep: bool) -> list[str]:
    experts, top_k = moe_layer(model, "cuda")
    dense = dense_bf16(experts)
    per_expert = expert_bytes(experts)
    hidden, inter = experts.down.shape[0] // experts.n_experts, experts.intermediate_size
    rows = []
    for m in batches:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(m, experts.n_experts, device="cuda")
        ours = timed(lambda: moe_triton(x, *route(logits, top_k, True), experts))  # noqa: B023
        chosen = route_ref(logits, top_k, True)[1].unique().numel()
        nbytes, flops = chosen * per_expert, 6 * m * top_k * hidden * inter
        peer, how = peer_us(dense, top_k, x, logits)
        limit = max(nbytes / bw, flops / peak) * 1e6
        rows.append(
            f"| {m} | {chosen} | {nbytes / 1e6:.1f} | {ours:.1f} | {nbytes / ours / 1e3:.0f} | "
            f"{100 * nbytes / ours / 1e-6 / bw:.0f}% | {flops / ours / 1e6:.1f} | {peer:.1f} ({how}) | "
            f"{peer / ours:.2f}x | {limit:.1f} |"
        )
        print(rows[-1], flush=True)
        if sweep:
            sweep_configs(experts, top_k, x, logits)
    shape = f"{experts.n_experts} experts, top-{top_k}, H {hidden}, I {inter}"
    header = [
        f"{model}: {shape}, {per_expert / 1e6:.2f} MB an expert",
        "| M | experts read | MB read | ours us | GB/s | % of copy | TFLOP/s | bf16 torch us | speed-up | limit us |",
        "|" + "---|" * 10,
    ]
    return header + rows


def sweep_configs(experts: Experts, top_k: int, x: torch.Tensor, logits: torch.Tensor) -> None:
    """Times candidate tile configs beside pick_config's; prints the five fastest."""
    m = x.shape[0]
    default = pick_config(m * top_k, experts.n_experts)
    weights, ids = route(logits, top_k, True)
    results = [(timed(lambda: moe_triton(x, weights, ids, experts, default)), "default", default)]
    block_ms = sorted({default.block_m, 8, 16} if m * top_k <= 4 * experts.n_experts else {default.block_m, 32, 64})
    for bm, bn_gu, bn_down, warps, stages in itertools.product(block_ms, (32, 64), (64, 128), (2, 4, 8), (3, 5)):
        cfg = MoeConfig(bm, bn_gu, bn_down, warps, stages)
        try:
            results.append((timed(lambda: moe_triton(x, weights, ids, experts, cfg)), "", cfg))  # noqa: B023
        except Exception as e:  # too much shared memory for a tile: go on
            print(f"  {cfg}: {type(e).__name__}")
    results.sort(key=lambda r: r[0])
    best = "; ".join(f"{us:.1f} {tag}{tuple(c.__dict__.values())}" for us, tag, c in results[:5])
    print(f"  sweep M={m}: {best}; default {results[[r[1] for r in results].index('default')][0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, action="append", help="a layer to run (default: both)")
    parser.add_argument("--m", type=int, nargs="+", default=BATCHES, help="the steps' row counts")
    parser.add_argument("--sweep", action="store_true", help="also time candidate tile configs at each M")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw, peak = said_limits()
    tables = [layer_rows(model, args.m, bw, peak, args.sweep) for model in args.model or MODELS]
    print()
    for table in tables:
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
