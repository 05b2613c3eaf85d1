"""The batched sampler (kernels/sampling_triton.py) at real shapes, beside its peers in the same run:

    python -m tests.benchmarks.sampler_bench

Peers: torch.argmax for greedy rows (what a greedy engine pays at least), the sort-based top-k / top-p sampler in
torch that vLLM falls back to without FlashInfer (penalties, temperature, a full sort, softmax, cumsum, an
exponential race: every row at once), and the row-by-row sampler this engine ran before (tests/sampling_oracle.py).
Floor: the bytes a sampler must move, one read of the logits and, for penalised rows, of the token counts and the
prompt marks, over the copy bandwidth measured here. Times are medians of CUDA-event timings (triton's do_bench)
of CUDA-graph replays, as the engine runs them (its step's graph holds the sampler): eager launches of a few small
kernels would time Python. The row-by-row sampler cannot be captured (it copies host lists): its time is eager.
"""

import sys

import torch
import triton

from llamaterm.engine.bench import copy_bandwidth
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.kernels.sampling_triton import sample_triton
from tests.support.sampling_cases import Batch, logits_like
from tests.support.sampling_oracle import sample_row

CONFIGS = {
    "greedy": SamplingParams(),
    "temperature 1": SamplingParams(temperature=1.0),
    "every filter + rep 1.1": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
    "top-p 0.9 alone": SamplingParams(temperature=0.7, top_p=0.9),
}


def torch_native(
    logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, p: SamplingParams
) -> torch.Tensor:
    """vLLM's forward_native in outline, with its penalties: all rows at once, a full sort per row."""
    if p.greedy:
        return logits.argmax(-1)
    x = logits
    if p.repetition_penalty != 1.0:
        seen = (in_prompt != 0) | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x / p.temperature
    if p.top_k or p.top_p < 1:
        xs, order = x.sort(dim=-1, descending=False)
        if p.top_k:
            kth = xs[:, -p.top_k : -p.top_k + 1]
            xs = xs.masked_fill(xs < kth, float("-inf"))
        if p.top_p < 1:
            cum = xs.softmax(-1).cumsum(-1)
            xs = xs.masked_fill(cum <= 1 - p.top_p, float("-inf"))
            xs[:, -1] = torch.maximum(xs[:, -1], x.max(-1).values)
        x = torch.empty_like(xs).scatter_(-1, order, xs)
    probs = x.softmax(-1)
    if p.min_p:
        probs = probs.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, 0)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def graphed(f):
    """f captured in a CUDA graph (after a run outside it, which compiles and allocates): its replay."""
    f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    return graph.replay


def row(name: str, p: SamplingParams, kind: str, rows: int, vocab: int, bandwidth: float) -> str:
    batch = Batch([p] * rows, seed=rows, slots=256, vocab=vocab)
    tables = batch.tables_on("cuda")
    logits = logits_like(kind, rows, seed=vocab, vocab=vocab).cuda()
    slots, positions = batch.slots.cuda(), batch.positions.cuda()
    us = lambda f, **kw: triton.testing.do_bench(f, return_mode="median", **kw) * 1e3
    ours = us(graphed(lambda: sample_triton(logits, slots, positions, tables)))
    peer = us(graphed(lambda: torch_native(logits, tables.counts[slots], tables.in_prompt[slots], p)))
    old = ""
    if rows == 64 and vocab == 49152:  # the sampler this engine ran before, at the default model's vocabulary
        exp = torch.empty(vocab, device="cuda").exponential_()
        history = [(batch.prompts[i] + batch.generated[i], batch.generated[i]) for i in range(rows)]
        old = f"{us(lambda: [sample_row(logits[i], p, *history[i], exp) for i in range(rows)], rep=200):11.0f}"
    floor = rows * vocab * (4 + 5 * (p.repetition_penalty != 1.0)) / bandwidth * 1e6
    label = name + (" (flat)" if kind == "flat" else "")
    return f"{label:24} {rows:4d} {vocab:7d} {ours:8.1f} {peer:11.1f} {old:>11} {floor:7.1f} {ours / floor:10.1f}"


def main() -> None:
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); times in microseconds")
    print(
        f"{'sampling':24} {'rows':>4} {'vocab':>7} {'ours':>8} {'torch sort':>11} {'row by row':>11} {'floor':>7}"
        f" {'ours/floor':>10}"
    )
    quick = "--quick" in sys.argv  # the rows with every filter only
    for vocab in (49152, 128256):
        for rows in (8, 64):
            for name, p in CONFIGS.items():
                if quick and "every" not in name:
                    continue
                for kind in ("peaked",) + (("flat",) if name == "top-p 0.9 alone" else ()):
                    print(row(name, p, kind, rows, vocab, bandwidth))


if __name__ == "__main__":
    main()
