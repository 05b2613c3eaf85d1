"""Benchmarks of the whole engine. Each prints our figure beside a peer measured in the same run and the limit.

  python -m llamaterm.engine.bench cpu     single-stream decode on the default model vs transformers (fp32)
  python -m llamaterm.engine.bench batch   aggregate decode tok/s for 1, 2, 4, 8 sessions, static vs dynamic arrivals
  python -m llamaterm.engine.bench random  the same on CUDA for random 4-bit weights in Llama-3-8B's shapes, with
                                           and without CUDA graphs, beside the weight-read limit
"""

import argparse
import random
import statistics
import time

import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.config import ModelConfig, weight_shapes
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.model import Model
from llamaterm.engine.store.model_store import default_model_path
from llamaterm.kernels.cpu_native import threads
from llamaterm.kernels.qweight import QuantWeight

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(64 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    n = 5
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 4 * n / (time.perf_counter() - t)


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights one decode step reads on this engine's path (dense copies on the CPU reference path)."""
    total = 0
    model = engine.model
    parts = [model.lm_head, model.output_norm]
    for layer in model.layers:
        parts += [*layer.qkv, layer.o, *layer.gate_up, layer.down, layer.attn_norm, layer.ffn_norm]
    for w in parts:
        if isinstance(w, QuantWeight):
            params = (w.scales,) if w.offsets is None else (w.scales, w.offsets)
            total += sum(d.numel() * d.element_size() for d in w._dense.values()) if w._dense else (
                w.packed.numel() + sum(t.numel() * t.element_size() for t in params))
        else:
            total += w.numel() * w.element_size()
    return total


def decode_rate(handle) -> float:
    times = list(handle.seq.token_times)
    return (len(times) - 1) / (times[-1] - times[0])


def bench_cpu(tokens: int) -> None:
    """Both engines in this one process, one after the other: three greedy runs each, medians. TTFT is from
    submitting the chat prompt to its first token; load is from the GGUF file to a model ready to serve."""
    import transformers

    torch.manual_seed(0)
    t = time.perf_counter()
    engine = Engine.from_model(EngineConfig(device="cpu"))
    ours_load = time.perf_counter() - t
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    ours = []
    for _ in range(3):
        _, handle = engine.generate(PROMPT, params)
        ours.append((decode_rate(handle), handle.stats().ttft_s))
    ours_tokens = handle.seq.generated
    ids = engine.tokenizer.encode_chat(PROMPT)
    wbytes = weight_bytes(engine)
    engine.shutdown()

    path = default_model_path()
    t = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    theirs_load = time.perf_counter() - t
    theirs = []
    for _ in range(3):
        hf_tokens, times = [], []
        with torch.inference_mode():
            x, past, start = torch.tensor([ids]), None, time.perf_counter()
            for _ in range(tokens):
                r = hf(input_ids=x, past_key_values=past, use_cache=True)
                past, token = r.past_key_values, int(r.logits[0, -1].argmax())
                hf_tokens.append(token)
                times.append(time.perf_counter())
                x = torch.tensor([[token]])
        theirs.append(((len(times) - 1) / (times[-1] - times[0]), times[0] - start))
    bw = copy_bandwidth(torch.device("cpu"))
    limit = bw / 2 / wbytes  # a copy moves each byte twice; decode reads each weight byte once
    median = lambda runs, i: statistics.median(r[i] for r in runs)
    print(f"CPU decode, default model (SmolLM2-135M Q4_1), {tokens} tokens, {threads()} threads; medians of 3 runs")
    print(f"{'':28}{'tok/s':>10}{'TTFT ms':>10}{'load s':>9}   runs (tok/s)")
    for name, runs, load in (("llamaterm (fp32)", ours, ours_load), ("HF transformers (fp32)", theirs, theirs_load)):
        print(f"{name:28}{median(runs, 0):10.1f}{median(runs, 1) * 1e3:10.0f}{load:9.2f}   "
              + " ".join(f"{r[0]:.1f}" for r in runs))
    print(f"{'speed-up':28}{median(ours, 0) / median(theirs, 0):9.2f}x")
    print(f"{'memory limit':28}{limit:10.1f}   ({wbytes / 1e6:.0f} MB read per token at {bw / 2e9:.1f} GB/s)")
    print(f"same tokens as transformers: {ours_tokens == hf_tokens}")


def bench_batch(sessions: list[int], tokens: int, device: str | None, model: str | None, eager: bool) -> None:
    engine = Engine.from_model(EngineConfig(model=model, device=device, cuda_graphs=not eager))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [[{"role": "user", "content": f"Story number {i}: tell me about a lighthouse keeper."}]
               for i in range(max(sessions))]
    engine.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    mode = " (CUDA graphs)" if engine.runner.graphs else ""
    print(f"Aggregate decode tok/s, {engine.model_name} on {engine.device}{mode}, {tokens} new tokens per session")
    print(f"{'sessions':>8} {'static':>10} {'dynamic':>10} {'static/1':>9}")
    base = None
    rng = random.Random(0)
    for n in sessions:
        row = []
        for staggered in (False, True):
            t0 = time.perf_counter()
            handles = []
            for i in range(n):
                handles.append(engine.submit(prompts[i], params))
                if staggered:  # sessions join over the first part of the run
                    time.sleep(rng.random() * 0.3)
            for h in handles:
                list(h.events())
            row.append(n * tokens / (time.perf_counter() - t0))
        base = base or row[0]
        print(f"{n:8d} {row[0]:10.1f} {row[1]:10.1f} {row[0] / base:8.2f}x")
    engine.shutdown()


LLAMA3_8B = ModelConfig(arch="llama", name="random weights in Llama-3-8B shapes", n_layers=32, hidden_size=4096,
                        intermediate_size=14336, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=128256,
                        context_length=8192, rms_norm_eps=1e-5, rope_theta=500000.0)


def random_model(c: ModelConfig, device: torch.device) -> Model:
    """4-bit group-128 symmetric weights with random values, made on the device: speed does not depend on them."""
    def q4(n: int, k: int) -> QuantWeight:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
        return QuantWeight.from_values(q, torch.rand(n, k // 128, device=device).half() * 2e-3 + 1e-3, None, 4, 128)

    t = {f"{name}.weight": q4(*shape) if len(shape) == 2 else torch.ones(shape, device=device)
         for name, shape in weight_shapes(c).items()}
    return Model(c, t, device, torch.float16)


class NoText:
    """A tokenizer stand-in for token-id prompts: no stop tokens, no text out."""

    stop_ids = ()

    def detokenizer(self) -> "NoText":
        return self

    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def bench_random(sessions: list[int], tokens: int) -> None:
    """Static batches of 64-token prompts; the rate is taken over each run's last 31 decode steps (steady state)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model(LLAMA3_8B, device)
    bw = copy_bandwidth(device)
    engine = Engine(model, NoText(), kv_tokens=64 * 1024, cuda_graphs=False)
    read = weight_bytes(engine)
    print(f"Aggregate decode tok/s, {LLAMA3_8B.name}, fp16 activations, {tokens} new tokens per session")
    print(f"weights read per step {read / 1e9:.2f} GB; copy bandwidth {bw / 1e12:.2f} TB/s: at most "
          f"{bw / read:.0f} steps/s")
    rates = {}
    for graphs in (False, True):
        if graphs:
            engine.shutdown()
            engine = Engine(model, NoText(), kv_tokens=64 * 1024)
        warm = [engine.submit(None, SamplingParams(max_tokens=8, ignore_eos=True), prompt_ids=[1] * 64)
                for _ in range(max(sessions))]
        for h in warm:  # every prefill and decode shape compiled before timing
            list(h.events())
        for n in sessions:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            handles = [engine.submit(None, params, prompt_ids=[(7 * i + j) % 50000 + 100 for j in range(64)])
                       for i in range(n)]
            for h in handles:
                list(h.events())
            start = max(h.seq.token_times[0] for h in handles)  # token_times keeps each sequence's last 32
            end = max(h.seq.token_times[-1] for h in handles)
            rates[graphs, n] = sum(sum(t > start for t in h.seq.token_times) for h in handles) / (end - start)
    engine.shutdown()
    print(f"{'sessions':>8} {'graphs':>10} {'eager':>10} {'graphs/1':>9} {'step ms':>8} {'% of limit':>10}")
    for n in sessions:
        r = rates[True, n]
        print(f"{n:8d} {r:10.1f} {rates[False, n]:10.1f} {r / rates[True, sessions[0]]:8.2f}x "
              f"{n / r * 1e3:8.2f} {100 * r / n / (bw / read):9.0f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["cpu", "batch", "random"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--sessions", default="1,2,4,8")
    ap.add_argument("--device")
    ap.add_argument("--model")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: launch every decode step's kernels")
    args = ap.parse_args()
    if args.what == "cpu":
        bench_cpu(args.tokens)
    elif args.what == "random":
        bench_random([int(s) for s in args.sessions.split(",")], args.tokens)
    else:
        bench_batch([int(s) for s in args.sessions.split(",")], args.tokens, args.device, args.model, args.eager)


if __name__ == "__main__":
    main()
