"""Kernel benchmarks on CUDA, beside their peers and the device's limits, measured in the same run.

    python -m tests.benchmarks.kernels_bench            # the tables recorded in BENCHMARKS.md
    python -m tests.benchmarks.kernels_bench --sweep    # also time candidate tile configs (tuning pick_config)

Timing: each measured region is captured in a CUDA graph (the engine's decode path launches the same way) and
replayed after an L2 flush, timed with CUDA events; the figure is the median. The flush reads 256 MB rather than
writing it: dirty lines left in L2 would be written back during the timed kernel (about 12 us of traffic).
Limits: time = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured here first. Bytes count each
input read once and each output written once (4-bit weights, their scales, activations in and out; the KV cache
for attention).
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llamaterm.kernels.attention_triton import AttentionConfig, paged_attention_triton
from llamaterm.kernels.linear_triton import Config, pick_config, qmatmul_triton
from llamaterm.kernels.qweight import QuantWeight
from llamaterm.kernels.qweight_triton import gpu_layout
from llamaterm.kernels.triton_util import num_sms

LLAMA3_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
TARGET = {1: 3.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 3.0, 32: 2.2, 64: 1.5, 128: 0.9}  # speed over fp16 cuBLAS

_flush = None


def timed(fn, reps: int = 30, graph: bool = True) -> float:
    """Median microseconds of fn (captured as one CUDA graph), each replay after an L2 flush."""
    global _flush
    if _flush is None:
        _flush = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    fn()  # compile and allocate outside the capture
    run = fn
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(reps):
        _flush.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_limits() -> tuple[float, float]:
    """(copy bandwidth B/s counting read + write, dense bf16 matmul FLOP/s)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = timed(lambda: dst.copy_(src), reps=10, graph=False)  # a memcpy node in a graph runs slower
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = timed(lambda: a @ b, reps=10)
    return 2 * (2 << 30) / copy_us * 1e6, 2 * 8192**3 / mm_us * 1e6


def said_limits() -> tuple[float, float]:
    """measure_limits, said in one line with the device and torch's version."""
    bw, peak = measure_limits()
    print(
        f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul 8192^3 {peak / 1e12:.0f} TFLOP/s; torch {torch.__version__}"
    )
    return bw, peak


def random_qweight(n, k, bits=4, group=128, offsets=False) -> QuantWeight:
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 0.01 + 0.001).half()
    offs = (torch.randn(n, k // group, device="cuda") * 0.01).half() if offsets else None
    return QuantWeight.from_values(q, scales, offs, bits, group)


def tinygemm_weight(n, k, group):
    """torch's int4 tinygemm operands: packed weight and [K/g, N, 2] bf16 scales and zeros (random)."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    scales_zeros = torch.rand(k // group, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
    return weight, scales_zeros


@triton.jit
def _read_kernel(src, out, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """XOR of CHUNK int32 words per program: a kernel that reads its bytes and does nothing else."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        acc ^= tl.load(src + base + i + offs, mask=base + i + offs < n_words, other=0)
    tl.store(out + tl.program_id(0) * BLOCK + offs, acc)


def read_floor_us(weights: dict[str, QuantWeight]) -> float:
    """Time to read each weight's GPU-layout bytes (values and scales) in one launch per weight, in one graph: the
    floor for any kernel that must read them. Chunk and block: the fastest of 16 configs in a sweep."""
    chunk, block = 8192, 1024  # int32 words: 32 KB per program, 4 KB per load
    launches = []
    for w in weights.values():
        layout = gpu_layout(w)
        words = (layout.values.numel() + layout.scales.numel() * layout.scales.element_size()) // 4
        src = torch.empty(words, dtype=torch.int32, device="cuda")
        out = torch.empty(triton.cdiv(words, chunk) * block, dtype=torch.int32, device="cuda")
        launches.append((src, out, words))
    return timed(
        lambda: [
            _read_kernel[(triton.cdiv(n, chunk),)](src, out, n, CHUNK=chunk, BLOCK=block, num_warps=8)
            for src, out, n in launches
        ]
    )


def linear_table(bw: float, peak: float, group: int, sweep: bool) -> list[str]:
    weights = {name: random_qweight(n, k, group=group) for name, (n, k) in LLAMA3_8B_LINEARS.items()}
    floor = read_floor_us(weights)
    floor_bytes = sum(w.shape[0] * w.shape[1] // 2 + w.shape[0] * w.shape[1] // group * 2 for w in weights.values())
    dense = {
        name: torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02 for name, (n, k) in LLAMA3_8B_LINEARS.items()
    }
    try:
        tiny = {name: tinygemm_weight(n, k, group) for name, (n, k) in LLAMA3_8B_LINEARS.items()}
    except RuntimeError as e:  # tinygemm supports groups 32..256 on sm80+; say so if this build does not
        print(f"tinygemm unavailable for group {group}: {e}")
        tiny = None
    rows = [
        f"Read-only floor (a kernel that only reads the same weight bytes, one launch per layer, one graph): "
        f"{floor:.1f} us, {100 * floor_bytes / floor / 1e-6 / bw:.0f}% of copy BW",
        f"| M | ours us | ours GB/s | % of copy BW | fp16 cuBLAS us | ours / cuBLAS speed | target | "
        f"tinygemm g{group} us | limit us |",
        "|" + "---|" * 9,
    ]
    for m in BATCHES:
        xs = {
            name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in LLAMA3_8B_LINEARS.items()
        }
        xh = {name: x.half() for name, x in xs.items()}
        try:
            ours = timed(lambda: [qmatmul_triton(xs[nm], w) for nm, w in weights.items()])  # noqa: B023
        except Exception as e:  # report and go on: one failing shape should not hide the rest of the table
            rows.append(f"| {m} | failed: {type(e).__name__} |")
            continue
        cublas = timed(lambda: [F.linear(xh[nm], w) for nm, w in dense.items()])  # noqa: B023
        tg = (
            timed(
                lambda: [
                    torch.ops.aten._weight_int4pack_mm(xs[nm], w, group, sz)  # noqa: B023
                    for nm, (w, sz) in tiny.items()
                ]
            )
            if tiny
            else float("nan")
        )
        nbytes = sum(n * k // 2 + n * k // group * 2 + 2 * m * (n + k) for n, k in LLAMA3_8B_LINEARS.values())
        flops = sum(2 * m * n * k for n, k in LLAMA3_8B_LINEARS.values())
        limit = max(nbytes / bw, flops / peak) * 1e6
        gbs = nbytes / ours / 1e3
        speed = cublas / ours
        mark = "met" if speed >= TARGET[m] and (m > 16 or gbs * 1e9 >= 0.8 * bw) else "MISSED"
        rows.append(
            f"| {m} | {ours:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {cublas:.1f} | {speed:.2f}x | "
            f"{TARGET[m]}x: {mark} | {tg:.1f} | {limit:.1f} |"
        )
        if sweep and group == 128 and m in (1, 16):
            sweep_linear(weights, xs, m)
    return rows


def sweep_linear(weights, xs, m):
    """Times candidate configs per shape beside pick_config's; prints the five fastest."""
    tiles = [(16, 64, 4, 3), (16, 64, 4, 4), (16, 128, 4, 3), (16, 128, 8, 3), (16, 32, 2, 3)]
    if m <= 8:  # the mma.sync tile
        tiles += [(8, 64, 4, 3), (8, 64, 4, 4), (8, 32, 2, 3), (8, 128, 4, 3)]
    sms = num_sms(torch.device("cuda"))
    for name, w in weights.items():
        n, k = w.shape
        x = xs[name]
        steps = gpu_layout(w).values.shape[0]
        default = pick_config(m, n, k, w.group_size, steps, sms)
        results = [(timed(lambda: qmatmul_triton(x, w, default)), "default", default)]  # noqa: B023
        for bm, bn, warps, stages in tiles:
            for per_sm in (1, 2, 4, 8):
                split = max(1, min(round(per_sm * sms / (-(-n // bn) * -(-m // bm))), steps // 2))
                cfg = Config(bm, bn, split, warps, stages)
                results.append((timed(lambda: qmatmul_triton(x, w, cfg)), "", cfg))  # noqa: B023
        results.sort(key=lambda r: r[0])
        print(
            f"  sweep M={m} {name}: "
            + "; ".join(f"{us:.1f} {tag}{tuple(c.__dict__.values())}" for us, tag, c in results[:5])
            + f"; default {[r[0] for r in results if r[1]][0]:.1f}"
        )


def paged_inputs(batch, context, n_q=32, n_kv=8, head_dim=128, page=16, qlen=1):
    blocks = -(-context // page)
    k_cache = torch.randn(batch * blocks, page, n_kv, head_dim, device="cuda", dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * qlen
    q = torch.randn(batch * qlen, n_q, head_dim, device="cuda", dtype=torch.float16)
    return q, k_cache, v_cache, tables, lens, qsl


def sdpa_us(q, k, v, causal) -> str:
    """torch SDPA on contiguous tensors, flash backend (GQA through enable_gqa); another backend if flash refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backends, label in (([SDPBackend.FLASH_ATTENTION], ""), ([SDPBackend.EFFICIENT_ATTENTION], " (mem-eff)")):

        def run(backends=backends):
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        try:
            return f"{timed(run):.1f}{label}"
        except RuntimeError:
            continue
    return "n/a"


def decode_table(bw: float, sweep: bool) -> list[str]:
    rows = [
        "| batch | context | ours us | ours GB/s | % of copy BW | SDPA flash (contiguous) us | limit us |",
        "|" + "---|" * 7,
    ]
    for batch, context in [
        (1, 512),
        (1, 4096),
        (1, 32768),
        (4, 8192),
        (8, 4096),
        (16, 2048),
        (32, 1024),
        (64, 512),
        (16, 8192),
        (64, 4096),
        (8, 32768),
        (64, 32768),
    ]:
        q, kc, vc, tables, lens, qsl = paged_inputs(batch, context)
        ours = timed(lambda: paged_attention_triton(q, kc, vc, tables, lens, qsl, 128**-0.5))  # noqa: B023
        kd = torch.randn(batch, 8, context, 128, device="cuda", dtype=torch.float16)
        vd = torch.randn_like(kd)
        qd = q.view(batch, 1, 32, 128).transpose(1, 2)
        peer = sdpa_us(qd, kd, vd, False)
        nbytes = kc.numel() * 2 * 2 + 2 * q.numel() * 2
        rows.append(
            f"| {batch} | {context} | {ours:.1f} | {nbytes / ours / 1e3:.0f} | "
            f"{100 * nbytes / ours / 1e-6 / bw:.0f}% | {peer} | {nbytes / bw * 1e6:.1f} |"
        )
        if sweep and (batch, context) in ((1, 32768), (64, 512)):
            for block_n in (32, 64, 128):
                for warps, stages in ((4, 2), (4, 3), (8, 3)):
                    for splits in sorted(
                        {1, 2 * num_sms(q.device) // (batch * 8) or 1, 4 * num_sms(q.device) // (batch * 8) or 1}
                    ):
                        cfg = AttentionConfig(1, block_n, warps, stages, max(1, min(splits, context // 256)))
                        us = timed(lambda: paged_attention_triton(q, kc, vc, tables, lens, qsl, 0.1, config=cfg))  # noqa: B023
                        print(f"  sweep decode b{batch} c{context} {cfg}: {us:.1f} us")
    return rows


def prefill_table(peak: float, sweep: bool) -> list[str]:
    rows = ["| case | ours us | ours TFLOP/s | SDPA flash us | ours / SDPA speed |", "|---|---|---|---|---|"]
    for batch, chunk, prefix in [(1, 2048, 0), (4, 512, 0), (1, 512, 1536)]:
        context = chunk + prefix
        q, kc, vc, tables, lens, qsl = paged_inputs(batch, context, qlen=chunk)
        ours = timed(lambda: paged_attention_triton(q, kc, vc, tables, lens, qsl, 128**-0.5))  # noqa: B023
        qd = torch.randn(batch, 32, chunk, 128, device="cuda", dtype=torch.float16)
        kd = torch.randn(batch, 8, context, 128, device="cuda", dtype=torch.float16)
        vd = torch.randn_like(kd)
        # SDPA's causal mask is top-left aligned, so it can only be compared on whole prompts (no prefix)
        peer = sdpa_us(qd, kd, vd, True) if prefix == 0 else "n/a"
        flops = 4 * batch * 32 * 128 * chunk * (prefix + (chunk + 1) / 2)
        speed = f"{float(peer.split()[0]) / ours:.2f}x" if peer[0].isdigit() else "-"
        rows.append(
            f"| {batch} x {chunk} tokens, prefix {prefix} | {ours:.1f} | {flops / ours / 1e6:.0f} | {peer} | {speed} |"
        )
        if sweep:
            for block_q, block_n, warps, stages in (
                (16, 64, 4, 3),
                (16, 64, 4, 4),
                (16, 128, 4, 3),
                (16, 32, 4, 3),
                (8, 64, 4, 3),
                (32, 64, 4, 3),
            ):
                cfg = AttentionConfig(block_q, block_n, warps, stages, 1)
                try:
                    us = timed(lambda: paged_attention_triton(q, kc, vc, tables, lens, qsl, 0.1, config=cfg))  # noqa: B023
                    print(f"  sweep prefill b{batch} chunk {chunk} prefix {prefix} {cfg}: {us:.1f} us")
                except Exception as e:
                    print(f"  skip {cfg}: {type(e).__name__}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs")
    parser.add_argument("--only", choices=["linear", "decode", "prefill"], help="run one table")
    args = parser.parse_args()
    torch.manual_seed(0)
    bw, peak = said_limits()
    tables = []
    if args.only in (None, "linear"):
        for group in (128, 32):
            tables.append(
                f"Llama-3-8B linears per block (qkv, o, gate_up, down), 4-bit group {group} symmetric, bf16 activations"
            )
            tables += linear_table(bw, peak, group, args.sweep)
    if args.only in (None, "decode"):
        tables.append("Paged decode attention, 32 q heads / 8 KV heads, head dim 128, fp16 KV, page 16")
        tables += decode_table(bw, args.sweep)
    if args.only in (None, "prefill"):
        tables.append("Prefill attention over the paged cache (causal), 32 q / 8 KV heads, head dim 128, fp16")
        tables += prefill_table(peak, args.sweep)
    print("\n".join(tables))


if __name__ == "__main__":
    main()
