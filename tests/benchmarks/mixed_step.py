"""What a step costs as prefill tokens ride beside decode rows: the step's CUDA graph replayed alone, for D decode
rows (each with `--context` tokens of context) and one prefill chunk of P tokens, against the decode step of D
alone. This is what the scheduler's pacing trades (engine/serving/scheduler.py): P tokens of prompt against the time
every decoding session waits.

    python -m tests.benchmarks.mixed_step -m synthetic:llama3-8b --decode 64 --prefill 0,32,64,128,192,256,448

Per row: the bucket the step pads to, the graph's time, the extra time over the decode step per prefill token,
the same with the linears on the fused 4-bit kernel instead of cuBLAS on the kept dense copies, and the time at
which the step's FLOPs would run at the dense fp16 matmul rate measured in the same run (the compute floor of a
step of that many rows). The kernel table of one mixed step follows (`--profile P`).
"""

import argparse

import torch

from llamaterm.engine import bench as wl
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.model import StepLists
from llamaterm.kernels import linear_triton
from tests.benchmarks.step_profile import kernel_table, replay_ms


def composition(d: int, p: int, context: int, prefill_start: int, block_size: int, blocks: int) -> StepLists:
    """D decode rows of `context` tokens and a chunk of P prompt tokens from position prefill_start; each sequence
    has blocks of its own (values do not matter for speed; the slots written are never read)."""
    step = StepLists([], [], [], [], [], [0], [], [], [], [], [])
    next_block = 0

    def add(start: int, n: int, samples: bool) -> None:
        nonlocal next_block
        end = start + n
        table = [(next_block + i) % blocks for i in range(-(-end // block_size))]
        next_block += len(table)
        step.input_ids.extend([1] * n)
        step.positions.extend(range(start, end))
        step.slot_mapping.extend(table[q // block_size] * block_size + q % block_size for q in range(start, end))
        step.block_tables.append(table)
        step.context_lens.append(end)
        step.query_start_loc.append(step.query_start_loc[-1] + n)
        if samples:
            step.logits_indices.append(step.query_start_loc[-1] - 1)
            step.sampler_slots.append(len(step.sampler_slots))
            step.sample_positions.append(end)

    for _ in range(d):
        add(context - 1, 1, True)
    if p:
        add(prefill_start, p, True)
    return step


def step_ms(engine, step: StepLists) -> tuple[int, float, torch.cuda.CUDAGraph]:
    graphs = engine.core.runner.graphs
    bucket, device_step = graphs.prepare(step)
    if bucket not in graphs.graphs:
        graphs.warm(bucket)
        graphs.capture(bucket)
    graph = graphs.graphs[bucket].forward
    return bucket, replay_ms(graph, 30), graph


def forget(engine) -> None:
    """Drop the captured graphs above the decode buckets, so the next steps capture with the current linears."""
    graphs = engine.core.runner.graphs
    for bucket in [b for b in graphs.graphs if b > graphs.max_running]:
        del graphs.graphs[bucket]


def matmul_rate(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ b
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="synthetic:llama3-8b")
    parser.add_argument("--decode", type=int, default=63, help="decode rows (with the chunk's: at most max_running)")
    parser.add_argument("--context", type=int, default=512, help="context of each decode row")
    parser.add_argument("--prefill", default="0,32,64,96,128,192,256,384,448")
    parser.add_argument("--prefill-start", type=int, default=256, help="the chunk's first position")
    parser.add_argument("--profile", type=int, default=128, help="the prefill tokens of the step profiled")
    args = parser.parse_args()
    bench = wl.open_engine(args.model, "cuda", EngineConfig(max_running=64, kv_tokens=200_000))
    engine = bench.engine
    model, bm = engine.core.model, engine.core.block_manager
    flop_rate = matmul_rate(model.device)
    params, _ = wl.linear_params(model)
    sizes = [int(p) for p in args.prefill.split(",")]
    make = lambda p, d=args.decode: composition(d, p, args.context, args.prefill_start, bm.block_size, bm.num_blocks)
    try:
        rows = []
        for p in sizes:
            bucket, ms, _ = step_ms(engine, make(p))
            rows.append([p, bucket, ms])
        base = rows[0][2] if sizes[0] == 0 else None
        # the same steps with every linear on the fused 4-bit kernel (no cuBLAS on dense copies)
        kept = linear_triton.DENSE_M, linear_triton.DENSE_M_KEPT, linear_triton.DENSE_M_KEPT_SMALL
        linear_triton.DENSE_M = linear_triton.DENSE_M_KEPT = linear_triton.DENSE_M_KEPT_SMALL = 1 << 30
        forget(engine)
        for row in rows:
            row.append(step_ms(engine, make(row[0]))[1])
        linear_triton.DENSE_M, linear_triton.DENSE_M_KEPT, linear_triton.DENSE_M_KEPT_SMALL = kept
        forget(engine)
        alone = {p: step_ms(engine, make(p, 0))[1] for p in sizes if p}
        print(
            f"\n{bench.label}: {args.decode} decode rows of {args.context} tokens + a prefill chunk from position "
            f"{args.prefill_start}; fp16 matmul rate {flop_rate / 1e12:.0f} TFLOP/s; {params / 1e9:.2f} G params"
        )
        print("| prefill P | bucket | step ms | extra per P token µs | 4-bit kernel ms | P alone ms | FLOP floor ms |")
        print("|---|---|---|---|---|---|---|")
        for p, bucket, ms, q4 in rows:
            extra = f"{1e3 * (ms - base) / p:.1f}" if base is not None and p else "-"
            floor = 2 * params * bucket / flop_rate * 1e3
            print(f"| {p} | {bucket} | {ms:.3f} | {extra} | {q4:.3f} | {alone.get(p, 0):.3f} | {floor:.3f} |")
        _, _, graph = step_ms(engine, make(args.profile))
        print(f"\nkernels of the step with {args.decode} decode rows + {args.profile} prefill tokens:")
        print("\n".join(kernel_table(graph, rows=14)), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
