"""The workloads behind `llamaterm bench` (app/bench.py prints them): engines on real or synthetic models, the
static batch, the closed loop of sessions that come and go, TTFT, start-up, launches per step, the peers.

Every figure is measured in the calling process; nothing here prints.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from llamaterm.engine.api import EngineConfig, EngineStats, RequestStream
from llamaterm.engine.checkpoints.config import ModelConfig, tensor_shapes
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.serving.device import resolve_device
from llamaterm.engine.serving.engine import Engine, Sink, triton_cache_key_beside
from llamaterm.engine.serving.model import Model, Weight
from llamaterm.engine.synthetic import SYNTHETIC_PREFIX, SyntheticTokenizer, is_synthetic
from llamaterm.engine.workload import GREEDY, PromptMix, chat_message
from llamaterm.kernels.qweight import QuantWeight

if TYPE_CHECKING:
    from llamaterm.engine.serving.process import EngineProcess  # which loads its engine through this module


@dataclass(frozen=True)
class QuantFormat:
    """How a synthetic model stores its matrices: bits, group size, affine (with offsets) or symmetric; the
    embedding (and a tied lm_head) may take another width, as in GGUF files."""

    bits: int
    group: int
    affine: bool
    embd_bits: int


def _llama(name, layers, hidden, ffn, heads, kv, vocab, ctx, theta, head_dim=None, tied=False) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        name=name,
        n_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        vocab_size=vocab,
        context_length=ctx,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=tied,
    )


def _gemma3(name, layers, hidden, ffn, heads, kv) -> ModelConfig:
    """Gemma 3's text model as its GGUF holds it: five 1024-token sliding layers to one global, x8 linear RoPE on
    the global ones."""
    return replace(
        _llama(name, layers, hidden, ffn, heads, kv, 262144, 131072, 1e6, head_dim=256, tied=True),
        arch="gemma3",
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        embedding_scale=hidden**0.5,
        attention_scale=256**-0.5,
        rope_theta_sliding=1e4,
        rope_freq_factors=(8.0,) * 128,
        sliding_window=1024,
        sliding_layers=tuple(i % 6 < 5 for i in range(layers)),
    )


# Random weights in real models' shapes, so speed figures need no download. 4-bit formats as their usual files.
SYNTHETIC: dict[str, tuple[ModelConfig, QuantFormat]] = {
    "llama3-8b": (
        _llama("Llama-3-8B shapes", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
        QuantFormat(4, 128, False, 4),
    ),
    "llama2-7b": (
        _llama("Llama-2-7B shapes", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0),
        QuantFormat(4, 128, False, 4),
    ),
    "smollm2-135m": (
        _llama("SmolLM2-135M shapes", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, tied=True),
        QuantFormat(4, 32, True, 8),
    ),  # the default model's Q4_1 with a Q8_0 embedding
    "tiny": (_llama("tiny test shapes", 2, 256, 512, 8, 2, 512, 1024, 10000.0), QuantFormat(4, 32, False, 4)),
    "qwen2.5-7b": (
        replace(_llama("Qwen2.5-7B shapes", 28, 3584, 18944, 28, 4, 152064, 32768, 1e6), arch="qwen2", qkv_bias=True),
        QuantFormat(4, 128, False, 4),
    ),
    "gemma3-4b": (_gemma3("Gemma-3-4B shapes", 34, 2560, 10240, 8, 4), QuantFormat(4, 128, False, 4)),
    "gemma3-12b": (_gemma3("Gemma-3-12B shapes", 48, 3840, 15360, 16, 8), QuantFormat(4, 128, False, 4)),
}


def parse_synthetic(spec: str) -> tuple[str, bool]:
    """'synthetic:NAME' (4-bit) or 'synthetic:NAME:fp16' -> (NAME, quantized)."""
    name, _, fmt = spec.removeprefix(SYNTHETIC_PREFIX).partition(":")
    if name not in SYNTHETIC or fmt not in ("", "q4", "4bit", "fp16"):
        raise LlamatermError(
            f"unknown model {spec!r}: synthetic models are "
            f"{', '.join(SYNTHETIC_PREFIX + n for n in SYNTHETIC)}, with :fp16 or :q4 (the default)"
        )
    return name, fmt != "fp16"


def synthetic_model(name: str, quantized: bool, device: torch.device) -> Model:
    """Random weights made on the device: speed does not depend on their values."""
    config, fmt = SYNTHETIC[name]
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)

    def matrix(n: int, k: int, bits: int) -> Weight:
        if not quantized:
            return torch.randn(n, k, generator=g, device=device, dtype=dtype) * 0.02
        q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8, device=device)
        scales = (torch.rand(n, k // fmt.group, generator=g, device=device) * 2e-3 + 1e-3).half()
        offsets = -scales * (1 << (bits - 1)) if fmt.affine and bits == 4 else None
        return QuantWeight.from_values(q, scales, offsets, bits, fmt.group)

    tensors: dict[str, Weight] = {}
    for name_, shape in tensor_shapes(config).items():
        if name_ == "output.weight" and config.tie_word_embeddings:
            continue
        if len(shape) == 1:
            tensors[name_] = torch.ones(shape, device=device)
        else:
            n, k = shape
            tensors[name_] = matrix(n, k, fmt.embd_bits if name_ == "token_embd.weight" else fmt.bits)
    return Model(config, tensors, device, dtype)


@dataclass
class Bench:
    """An engine under test and what is known about it."""

    engine: Engine
    label: str  # what the tables call the model
    path: str | None  # the checkpoint, for peers that load it; None for synthetic weights
    quantized: bool


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def open_engine(model: str | None, device: str | None, config: EngineConfig, sink: Sink | None = None) -> Bench:
    """A real model (store name or path; None: the default model) or `synthetic:NAME[:fp16]`."""
    if not is_synthetic(model):
        engine = Engine.from_model(replace(config, model=model, device=device), sink=sink)
        from llamaterm.engine.store.model_store import resolve_model

        return Bench(engine, engine.model_name, str(resolve_model(model)), True)
    assert model is not None
    name, quantized = parse_synthetic(model)
    dev = resolve_device(device)
    with triton_cache_key_beside(dev):
        t = time.perf_counter()
        m = synthetic_model(name, quantized, dev)
        sync(dev)
        made = time.perf_counter() - t
    engine = Engine(m, SyntheticTokenizer(m.config.vocab_size), config, name=m.config.name, sink=sink)  # type: ignore[arg-type]
    engine.startup_s = {"make random weights": made, **engine.startup_s}
    fmt = SYNTHETIC[name][1]
    label = f"{m.config.name}, " + (f"{fmt.bits}-bit g{fmt.group}" if quantized else "fp16")
    return Bench(engine, label, None, quantized)


def weight_bytes(model: Model) -> int:
    """Bytes of weights one decode step reads: packed values, scales and offsets on the GPU (dense copies kept for
    prefill are not read by decode steps); the dense copies the CPU reference path multiplies with."""
    parts = [model.lm_head, model.output_norm]
    for layer in model.layers:
        parts += [*layer.qkv, layer.o, *layer.gate_up, layer.down, layer.attn_norm, layer.ffn_norm]
    return sum(read_bytes(w) for w in parts)


def read_bytes(w: Weight) -> int:
    """The bytes of w a decode step reads (see weight_bytes)."""
    size = lambda t: 0 if t is None else t.numel() * t.element_size()
    if not isinstance(w, QuantWeight):
        return size(w)
    if w.packed.device.type == "cpu" and w._dense:
        return sum(map(size, w._dense.values()))
    return size(w.packed) + size(w.scales) + size(w.offsets)


def engine_info(engine: Engine) -> dict:
    """What the bench tables need of an engine: where start-up went, the weight bytes a decode step reads, CUDA
    graphs or not, the dense copies kept for prefill."""
    return {
        "startup_s": engine.startup_s,
        "weight_bytes": weight_bytes(engine.model),
        "cuda_graphs": engine.runner.graphs is not None,
        "dense_weight_bytes": engine.dense_weight_bytes,
        "kv_tokens": engine.pool_tokens(),
        "memory_bytes": memory_held(engine),
    }


def memory_held(engine: Engine) -> int:
    """What the engine holds of its device's memory (`llamaterm ps`): on a GPU, torch's reservation; on the CPU,
    the weights and the KV cache."""
    device = engine.model.device
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    return weight_bytes(engine.model) + engine.pool_tokens() * engine.model.kv_bytes_per_token()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(64 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    n = 5
    sync(device)
    t = time.perf_counter()
    for _ in range(n):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 4 * n / (time.perf_counter() - t)


class Prompts:
    """Fresh random token-id prompts: no two share a prefix, so the prefix cache never shortens a prefill."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(min(100, self.vocab // 2), self.vocab) for _ in range(n)]


class Sessions:
    """How a benchmark's sessions are opened: on which engine (in this process, or the engine process `chat` and
    `serve` use), with chat messages or token-id prompts, sampled how (engine/workload.py). Token counts are
    forced, so every session makes the tokens it asks for."""

    def __init__(
        self,
        client: Engine | EngineProcess,
        chat: bool,
        sampling: dict,
        vocab: int,
        seed: int = 0,
        grammar: Grammar | None = None,
    ):
        self.client, self.chat, self.sampling, self.grammar = client, chat, sampling, grammar
        self.rng = random.Random(seed)
        self.prompts = Prompts(vocab, seed)

    def start(self, prompt_len: int, max_tokens: int) -> RequestStream:
        """A prompt that leaves room for the reply in the context (a word of chat is at most about two tokens)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, grammar=self.grammar, **self.sampling)
        room = self.client.max_context - max_tokens - 16
        if self.chat:
            return self.client.submit(chat_message(self.rng, min(prompt_len, room // 2)), params)
        return self.client.submit(None, params, prompt_ids=self.prompts(min(prompt_len, room)))

    def stats(self) -> EngineStats:
        return self.client.stats()


@dataclass
class SessionLog:
    """Token arrivals of a set of sessions, read by one polling thread (the same for every workload)."""

    token_times: list[float]
    first_token: list[float]  # per finished or open session, when its first token arrived
    finished: list[float]  # when each finished session's last token arrived
    gaps: list[tuple[float, float]]  # (when, seconds since the session's last token) per token after its first
    window_stats: list[EngineStats]  # the engine's stats at drive's `window` times (a measured window's two ends)

    def arrived(self, now: float, last: float | None, k: int) -> None:
        """k tokens of one session, seen together at `now`; its tokens before them at `last` (None: none)."""
        if last is None:
            self.first_token.append(now)
        else:
            self.gaps += [(now, (now - last) / k)] * k
        self.token_times += [now] * k


def drive(
    sessions: Sessions,
    n: int,
    start: Callable[[], RequestStream],
    replace: bool,
    seconds: float | None = None,
    window: tuple[float, ...] = (),
) -> SessionLog:
    """Keep n sessions open; each finished one is replaced at once when `replace` (a closed loop), else the run
    ends when all have finished. After `seconds`, open sessions are cancelled. Polls every 2 ms from this thread:
    one reader for any n, so the reader's cost does not grow with the sessions (gaps are seen to 2 ms; tokens
    that arrive together share the gap before them). `window` (seconds from the start): when to read the stats."""
    log = SessionLog([], [], [], [], [])
    handles: list[RequestStream | None] = [start() for _ in range(n)]
    last: list[float | None] = [None] * n
    t0 = time.perf_counter()
    marks = [t0 + w for w in window]
    while any(handles):
        time.sleep(0.002)
        now = time.perf_counter()
        if marks and now >= marks[0]:
            log.window_stats.append(sessions.stats())
            marks.pop(0)
        for i, h in enumerate(handles):
            if h is None:
                continue
            events = h.poll()
            k = sum(len(e.token_ids) for e in events)  # the tokens this poll brought, together
            if k:
                log.arrived(now, last[i], k)
                last[i] = now
            for event in events:
                if event.error:
                    raise LlamatermError(f"benchmark request failed: {event.error}")
                if event.finished:
                    log.finished.append(now)
                    handles[i], last[i] = (start() if replace else None), None
        if seconds is not None and now - t0 >= seconds:
            cancel_all(sessions, handles)
            break
    return log


def cancel_all(sessions: Sessions, handles: list[RequestStream | None]) -> None:
    """Cancels the sessions still open and reads each to its end."""
    for h in handles:
        if h is not None:
            sessions.client.cancel(h)
            list(h.events())


def rate(times: list[float], lo: float, hi: float) -> float:
    return sum(lo < t <= hi for t in times) / (hi - lo) if hi > lo else 0.0


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def static_rate(sessions: Sessions, n: int, prompt_len: int, tokens: int) -> float:
    """n sessions submitted at once; decode tok/s from the moment all have their first token to the first finish."""
    log = drive(sessions, n, lambda: sessions.start(prompt_len, tokens), False)
    return rate(log.token_times, max(log.first_token), min(log.finished))


def closed_loop(sessions: Sessions, n: int, mix: PromptMix, warmup_s: float, window_s: float) -> dict:
    """Dynamic sessions: n always open, each replaced at once by a new session with a new prompt when it ends;
    prompt and output lengths from `mix`. Over `window_s` after `warmup_s`: decode tok/s, a session's gap between
    two tokens (median, p99, max, in ms), and the engine's steps and host time per step."""
    rng = random.Random(1)
    client = sessions.client
    if isinstance(client, Engine):
        client.max_step_s = 0.0
    t0 = time.perf_counter()
    lo, hi = t0 + warmup_s, t0 + warmup_s + window_s
    log = drive(
        sessions, n, lambda: sessions.start(*mix.draw(rng)), True, warmup_s + window_s, (warmup_s, warmup_s + window_s)
    )
    gaps = [g for t, g in log.gaps if lo < t <= hi]
    tok_s = rate(log.token_times, lo, hi)
    out = {
        "tok_s": tok_s,
        "gap_ms": {
            "p50": 1e3 * percentile(gaps, 0.5),
            "p99": 1e3 * percentile(gaps, 0.99),
            "max": 1e3 * max(gaps, default=0.0),
        },
        "max_step_ms": 1e3 * client.max_step_s if isinstance(client, Engine) else None,
    }
    if len(log.window_stats) == 2:
        a, b = log.window_stats
        steps = b.steps - a.steps
        out |= {"steps_per_s": steps / window_s, "host_ms_per_step": 1e3 * (b.host_s - a.host_s) / max(1, steps)}
        if masked := b.mask_steps - a.mask_steps:
            per_step = lambda field: 1e3 * (getattr(b, field) - getattr(a, field)) / masked
            out["masks_ms_per_step"] = {k: per_step(f"mask_{k}_s") for k in ("fill", "tokens", "wait")}
            out["forced_share"] = (b.forced_tokens - a.forced_tokens) / max(1.0, tok_s * window_s)
    return out


def graphs_timeline(sessions: Sessions, n: int, prompt_len: int, seconds: float) -> dict:
    """Serve first, capture later, right after start-up: n sessions decode for `seconds` while the engine captures
    its CUDA graphs between their steps (a closed loop: a session that ends after `tokens` is replaced). When each
    step size's graph was ready (seconds after the engine was ready), the longest decode step replayed from graphs
    that the work ran beside and the work's longest turn beside a graph step and its slowest piece beside a step,
    beside a normal step (the median gap between two tokens of a
    session over the last second, every graph in use ready by then), and when the step sizes the sessions used were
    all captured (full graph speed: the latest graph ready as the sessions end, None if a step size in use was still
    to capture then). The graphs no step used are captured once the engine idles (wait_for_graphs); those ready by
    the time this returns are in graphs_ready_s too."""
    tokens = min(1024, sessions.client.max_context - prompt_len - 32)
    log = drive(sessions, n, lambda: sessions.start(prompt_len, tokens), True, seconds, (seconds - 0.1,))
    stats = sessions.stats()
    serving = log.window_stats[0] if log.window_stats else stats  # as the sessions end
    ready, captured = dict(stats.graphs_ready_s), dict(serving.graphs_ready_s)
    end = max(log.token_times, default=0.0)
    normal = statistics.median([g for t, g in log.gaps if t > end - 1.0] or [0.0])
    return {
        "sessions": n,
        "graphs_ready_s": ready,
        "full_graph_speed_s": None if serving.graphs_in_use_pending else max(captured.values(), default=None),
        "max_step_background_ms": 1e3 * stats.max_step_background_s,
        "max_background_turn_ms": 1e3 * stats.max_background_turn_s,
        "slowest_piece": [1e3 * stats.slowest_background_piece[0], stats.slowest_background_piece[1]],
        "normal_step_ms": 1e3 * normal,
        "pending_after": stats.graphs_pending,
    }


def wait_for_graphs(sessions: Sessions, timeout_s: float = 120.0) -> float:
    """Seconds until the engine had captured every graph it will capture unasked (it does when idle): the figures
    measured after it are steady-state. A one-token request now and then brings the stats of an engine process
    up to date."""
    t0 = time.perf_counter()
    while sessions.stats().graphs_pending and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.2)
        list(sessions.start(8, 1).events())
    return time.perf_counter() - t0


def ttft(sessions: Sessions, prompt_len: int, repeats: int = 5) -> float:
    """Median seconds from submit to the first token of one prompt on an idle engine."""
    out = []
    for _ in range(repeats):
        h = sessions.start(prompt_len, 1)
        list(h.events())
        ttft_s = h.stats().ttft_s
        assert ttft_s is not None  # its one token arrived
        out.append(ttft_s)
    return statistics.median(out)


LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def launches_per_step(engine: Engine, prompt_len: int, tokens: int, prompts: Prompts) -> dict[str, float] | None:
    """Host launch calls and GPU kernels per engine step (torch profiler, CUDA only) while one session runs on an
    otherwise idle engine: a replayed graph is one launch for all its kernels. A 1-token prompt makes every step
    a one-token (decode) step; tokens=1 makes one prefill step."""
    if engine.model.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # a larger step size's graph is captured once two steps used it (cuda_graph.py)
        engine.generate(None, SamplingParams(max_tokens=tokens, ignore_eos=True), prompt_ids=prompts(prompt_len))
    while engine.runner.background_pending(idle=True):  # captured in the background
        time.sleep(0.01)
    steps = engine.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(None, SamplingParams(max_tokens=tokens, ignore_eos=True), prompt_ids=prompts(prompt_len))
        sync(engine.model.device)
    steps = max(1, engine.num_steps - steps)
    events = prof.events()
    launches = sum(e.name in LAUNCH_CALLS for e in events)
    kernels = sum(
        e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")) for e in events
    )
    return {"steps": steps, "launches_per_step": launches / steps, "kernels_per_step": kernels / steps}


@dataclass
class GreedyRuns:
    """One engine's greedy runs on the same prompts as its peer's: decode tok/s (first token to last) and time to
    first token per run, the tokens of each run, and the seconds from the checkpoint to a model ready to serve."""

    load_s: float
    tok_s: list[float]
    ttft_s: list[float]
    tokens: list[list[int]]


def our_greedy_runs(bench: Bench, prompts: list[list[int]], tokens: int) -> GreedyRuns:
    """Each prompt is new to the engine (no cached prefix), so TTFT includes the whole prefill."""
    engine = bench.engine
    runs = GreedyRuns(sum(engine.startup_s.values()), [], [], [])
    for prompt in prompts:
        handle = engine.submit(None, SamplingParams(max_tokens=tokens, ignore_eos=True), prompt_ids=prompt)
        times: list[float] = []
        out: list[int] = []
        for event in handle.events():
            times += [time.perf_counter()] * len(event.token_ids)
            out += event.token_ids
        runs.tok_s.append((len(times) - 1) / (times[-1] - times[0]))
        ttft_s = handle.stats().ttft_s
        assert ttft_s is not None  # its tokens arrived
        runs.ttft_s.append(ttft_s)
        runs.tokens.append(out)
    return runs


def hf_greedy_runs(bench: Bench, prompts: list[list[int]], tokens: int) -> GreedyRuns:
    """Hugging Face transformers, greedy with its KV cache, one sequence at a time: the same checkpoint
    dequantized, or random weights in the same shapes."""
    import transformers

    engine = bench.engine
    dev, dtype = engine.model.device, engine.model.dtype
    t = time.perf_counter()
    hf: Any  # transformers' own stubs type .to(dtype) and the config's fields loosely
    if bench.path is not None and bench.path.endswith(".gguf"):
        from pathlib import Path

        p = Path(bench.path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype)
    elif bench.path is not None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(bench.path, dtype=dtype)
    else:
        c = engine.model.config
        shapes: dict[str, Any] = dict(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            max_position_embeddings=c.context_length,
            rope_theta=c.rope_theta,
            tie_word_embeddings=c.tie_word_embeddings,
        )
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes))
        hf = hf.to(dtype)
    hf = hf.to(dev).eval()
    sync(dev)
    runs = GreedyRuns(time.perf_counter() - t, [], [], [])
    for prompt in prompts:
        out, times = [], []
        with torch.inference_mode():
            x, past, start = torch.tensor([prompt], device=dev), None, time.perf_counter()
            for _ in range(tokens):
                r = hf(input_ids=x, past_key_values=past, use_cache=True)
                past, token = r.past_key_values, int(r.logits[0, -1].argmax())
                out.append(token)
                times.append(time.perf_counter())
                x = torch.tensor([[token]], device=dev)
        runs.tok_s.append((len(times) - 1) / (times[-1] - times[0]))
        runs.ttft_s.append(times[0] - start)
        runs.tokens.append(out)
    del hf, past
    return runs


def linear_params(model: Model) -> tuple[int, int]:
    """Weights multiplied per token by the blocks, and by the lm_head (sampled tokens only)."""
    size = lambda w: w.shape[0] * w.shape[1]
    blocks = sum(size(w) for layer in model.layers for w in (*layer.qkv, layer.o, *layer.gate_up, layer.down))
    return blocks, size(model.lm_head)


def grid_cell(engine: Engine, batch: int, prompt_len: int, out_len: int, prompts: Prompts) -> dict:
    """The ColossalAI / vLLM table's cell: a static batch of token-id prompts, greedy, prompt_len in and out_len out,
    timed whole."""
    dev = engine.model.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sessions = Sessions(engine, False, GREEDY, engine.model.config.vocab_size)
    sessions.prompts = prompts
    t = time.perf_counter()
    drive(sessions, batch, lambda: sessions.start(prompt_len, out_len), False)
    elapsed = time.perf_counter() - t
    c = engine.model.config
    blocks, head = linear_params(engine.model)
    total = prompt_len + out_len  # token p attends to p + 1 keys: QK^T and PV, 2 FLOPs per multiply-add
    flops = batch * (
        2 * blocks * total + 2 * head * out_len + 4 * c.n_layers * c.n_heads * c.head_dim * total * (total + 1) // 2
    )
    peak = (
        (torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev))
        if dev.type == "cuda"
        else (None, None)
    )
    return {
        "batch": batch,
        "input": prompt_len,
        "output": out_len,
        "seconds": elapsed,
        "ms_per_token": elapsed / out_len * 1e3,
        "tok_s": batch * out_len / elapsed,
        "tflop_s": flops / elapsed / 1e12,
        "peak_allocated_gb": peak[0] and peak[0] / 1e9,
        "peak_reserved_gb": peak[1] and peak[1] / 1e9,
    }


# ---- speculative decoding: replies with and without drafts ----

OPEN_CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are the pros and cons of working from home? Give a balanced answer.",
    "Describe a good plan for learning to play the guitar in three months.",
)


@dataclass(frozen=True)
class EditText:
    """An editing request: a text, and a name in it to change (`# rename: OLD -> NEW` on its first line)."""

    name: str
    text: str
    old: str
    new: str

    @classmethod
    def read(cls, name: str, source: str) -> EditText:
        first, _, text = source.partition("\n")
        old, arrow, new = first.removeprefix("# rename:").partition("->")
        if not first.startswith("# rename:") or not arrow or not old.strip() or not new.strip():
            raise LlamatermError(f"{name}: the first line must be '# rename: OLD -> NEW'")
        return cls(name, text, old.strip(), new.strip())

    def messages(self) -> list[dict]:
        ask = f"Rewrite this code with `{self.old}` renamed to `{self.new}`. Reply with the whole code only."
        return [{"role": "user", "content": f"{ask}\n\n```python\n{self.text}```"}]


def speculation_run(
    engine: Engine, prompts: list[list[dict]], sessions: int, params: SamplingParams, speculate: str
) -> dict[str, Any]:
    """Every prompt once at least, `sessions` requests at a time (request i: prompt i % len(prompts), seed i), the
    engine speculating as `speculate` says: the decode rate from each wave's first token to its last, tokens per
    step, and the drafts' acceptance. Seeds are fixed, so with and without speculation the replies are the same
    tokens (checked by the caller)."""
    engine.speculate = speculate
    before = engine.stats()
    handles, seconds = [], 0.0
    for start in range(0, max(sessions, len(prompts)), sessions):
        wave = [
            engine.submit(prompts[i % len(prompts)], replace(params, seed=i)) for i in range(start, start + sessions)
        ]
        for h in wave:
            list(h.events())
        seconds += max(h.finish_time or 0.0 for h in wave) - min(h.seq.first_token_time or 0.0 for h in wave)
        handles += wave
    after = engine.stats()
    tokens = sum(len(h.seq.generated) for h in handles)
    drafted, kept = after.drafted - before.drafted, after.kept - before.kept
    return {
        "tok_s": (tokens - len(handles)) / seconds if seconds > 0 else 0.0,  # the tokens after each first one
        "tokens": tokens,
        "steps": after.steps - before.steps,
        "tokens_per_step": tokens / max(1, after.steps - before.steps),
        "drafted": drafted,
        "draft_steps": after.draft_steps - before.draft_steps,
        "serial_steps": after.serial_steps - before.serial_steps,
        "acceptance": kept / drafted if drafted else None,
        "replies": [h.seq.generated for h in handles],
    }


# greedy, and llama.cpp's defaults (the default model's own)
SPECULATION_SAMPLINGS = {"greedy": GREEDY, "sampled": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}}


def speculation_workloads(edits: list[EditText]) -> dict[str, list[list[dict]]]:
    """Editing requests (replies that mostly repeat the prompt) and open chat."""
    return {
        "editing": [e.messages() for e in edits],
        "open chat": [[{"role": "user", "content": t}] for t in OPEN_CHAT],
    }


def speculation_table(
    engine: Engine, speculate: str, counts: list[int], edits: list[EditText], max_tokens: int, progress: Callable
) -> list[dict[str, Any]]:
    """speculation_workloads, greedy and sampled (SPECULATION_SAMPLINGS), at each session count: tok/s without
    speculation and with `speculate`, acceptance, tokens per step."""
    workloads, samplings = speculation_workloads(edits), SPECULATION_SAMPLINGS
    rows = []
    for (workload, prompts), (sampling, values), n in itertools.product(workloads.items(), samplings.items(), counts):
        progress(f"speculation: {workload}, {sampling}, {n} sessions")
        params = SamplingParams(max_tokens=max_tokens, **values)
        speculation_run(engine, prompts, n, replace(params, max_tokens=16), speculate)  # warm: graphs, buckets
        while engine.runner.background_pending(idle=True):  # the graphs captured when idle, before the runs
            time.sleep(0.01)
        off = speculation_run(engine, prompts, n, params, "off")
        on = speculation_run(engine, prompts, n, params, speculate)
        rows.append(
            {
                "workload": workload,
                "sampling": sampling,
                "sessions": n,
                "off_tok_s": off["tok_s"],
                "on_tok_s": on["tok_s"],
                "speedup": on["tok_s"] / off["tok_s"] if off["tok_s"] else None,
                "acceptance": on["acceptance"],
                "tokens_per_step": on["tokens_per_step"],
                "off_tokens_per_step": off["tokens_per_step"],
                "steps": (off["steps"], on["steps"]),
                "draft_steps": on["draft_steps"],
                "serial_steps": on["serial_steps"],
                "tokens": on["tokens"],
                "same_tokens": on["replies"] == off["replies"],
            }
        )
    engine.speculate = speculate
    return rows
