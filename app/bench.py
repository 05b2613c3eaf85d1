"""`llamaterm bench`: the engine's speed on this machine, beside the limit (and a peer) measured in the same run.

app/cli.py calls register(app). torch and the engine load inside the command. Tables go to stdout (or one JSON
object with --json); the progress bar to stderr. The workloads live in engine/bench.py.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llamaterm.app.console import fail, interrupts_held, startup_split
from llamaterm.app.inputs import reply_grammar
from llamaterm.engine.api import EngineConfig
from llamaterm.engine.workload import PromptMix

if TYPE_CHECKING:
    from llamaterm.engine.sampling_params import Grammar

GRID = [(i, o, b) for i in (128, 512, 1024) for o in (128, 256) for b in (16, 32, 64)]


class Progress:
    """Where a benchmark is, on stderr: one line redrawn on a terminal ([#####.....] 3/12 what is running now);
    elsewhere (a log, CI, a remote run cut off by its time limit) a line a part with the seconds since the start,
    so a run that never ends still shows where it stopped."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.redrawn = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.redrawn:
            print(f"[{time.perf_counter() - self.start:6.1f} s] {self.done}/{self.total} {what}", file=sys.stderr)
            return
        width = 24
        fill = width * (self.done - 1) // max(1, self.total)
        sys.stderr.write(f"\r\033[K[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {what}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.redrawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


WORKLOADS = {  # --workload: prompts, sampling, engine
    "chat": ("chat", "filters", "process"),  # what users send: chat messages, every filter on, the engine process
    "ids": ("ids", "greedy", "inline"),  # the engine alone: token-id prompts, greedy, in this process
}


def bench(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help=(
                "Model name in the store, a path, or synthetic:NAME, random 4-bit weights in a model's shapes (NAME: "
                "llama3-8b, llama2-7b, smollm2-135m, qwen2.5-7b, gemma3-4b, gemma3-12b, tiny, and the mixtures "
                "qwen3-30b-a3b, gpt-oss-20b (MXFP4 experts), tiny-moe; add :fp16 for fp16)."
            ),
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    workload: Annotated[
        str,
        typer.Option(
            help="chat: chat messages through the engine process `chat` and `serve` use, sampled with every filter "
            "on (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repetition penalty 1.1). ids: token-id prompts, "
            "greedy, the engine in this process."
        ),
    ] = "chat",
    sampling: Annotated[str | None, typer.Option(help="filters or greedy, in place of the workload's own.")] = None,
    engine_kind: Annotated[
        str | None,
        typer.Option("--engine", help="process (the engine in its own process) or inline, in place of the workload's."),
    ] = None,
    prompt_mix: Annotated[
        str,
        typer.Option(
            help="fixed: --prompt tokens, replies of 64-448 tokens in the closed loop. chat: prompts of 16-256 (70%), "
            "256-1024 (25%) and 1024-2000 tokens (5%), replies of 32-512."
        ),
    ] = "fixed",
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Drive `llamaterm serve` (started for the run, or the one at --url) with streaming clients of the "
            "openai package over --processes processes, as many as the largest --sessions count, instead of the "
            "engine.",
        ),
    ] = False,
    url: Annotated[
        str | None, typer.Option(help="With --serve: the server's base URL, e.g. http://host:8000/v1.")
    ] = None,
    processes: Annotated[int, typer.Option(min=1, help="Client processes for --serve.")] = 8,
    sessions: Annotated[
        str | None, typer.Option(help="Session counts, e.g. 1,8,64 (default: 1,8,64; with --scaling 1,2,4,8,16,32,64).")
    ] = None,
    scaling: Annotated[bool, typer.Option("--scaling", help="Every power of two of sessions up to 64.")] = False,
    grid: Annotated[
        bool,
        typer.Option(
            "--grid", help="The ColossalAI / vLLM table: input 128/512/1024 x output 128/256 x batch 16/32/64."
        ),
    ] = False,
    peer: Annotated[
        str | None, typer.Option(help="hf: Hugging Face transformers on the same model, one session, three runs each.")
    ] = None,
    tokens: Annotated[
        int, typer.Option(min=2, help="New tokens per session in static batches (--speculate: a reply's most).")
    ] = 128,
    prompt: Annotated[
        int, typer.Option(min=1, help="Prompt tokens per session (chat: words, about a token each).")
    ] = 128,
    window: Annotated[float, typer.Option(min=0.1, help="Seconds the closed loop is measured for.")] = 10.0,
    warmup: Annotated[float, typer.Option(min=0.0, help="Seconds the closed loop runs before that.")] = 3.0,
    eager: Annotated[bool, typer.Option("--eager", help="No CUDA graphs: launch every kernel.")] = False,
    kv_tokens: Annotated[int | None, typer.Option(min=16, help="KV cache pool size in tokens.")] = None,
    ctx: Annotated[
        int | None,
        typer.Option(
            "--ctx",
            min=16,
            help="Context length (default: the model's own), as chat, run and serve take it.",
            show_default=False,
        ),
    ] = None,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            help="Every reply follows this JSON schema (a file), as `run --json-schema` constrains one; each static "
            "batch and closed loop runs free too, just before, on the same engine, and the table says how they compare."
        ),
    ] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Run each static batch and closed loop this many times.")] = 1,
    speculate: Annotated[
        str,
        typer.Option(
            help="ngram or draft: instead of the tables above, editing requests (a reply that repeats its prompt "
            "with a name changed, the texts of --edit-texts) and open chat, greedy and sampled, at --sessions (default "
            "1,8): tok/s without speculation and with it, its acceptance and tokens per step. off (the default): the "
            "tables above, without speculation (random weights' greedy replies repeat, which drafts would cut short)."
        ),
    ] = "off",
    draft: Annotated[str | None, typer.Option(help="The draft model of --speculate draft.")] = None,
    speculate_tokens: Annotated[
        int, typer.Option(min=1, help="Drafts ride while a step samples at most this many rows (rows + drafts).")
    ] = EngineConfig.speculate_tokens,
    edit_texts: Annotated[
        Path, typer.Option(help="A folder of texts to edit (*.txt, first line '# rename: OLD -> NEW').")
    ] = Path("tests/benchmarks/editing"),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Measure decode tok/s by sessions, a session's gap between tokens, TTFT and start-up, against the weight-read
    limit, on the path users take: chat messages, sampled, through the engine process.

    Examples:

      llamaterm bench --model synthetic:llama3-8b --prompt-mix chat

      llamaterm bench --workload ids --scaling

      llamaterm bench --serve --sessions 64

      llamaterm bench --device cpu --peer hf --sessions 1

      llamaterm bench --json-schema tests/benchmarks/people.schema.json

      llamaterm bench --speculate ngram --sessions 1,8
    """
    if workload not in WORKLOADS:
        fail(f"unknown workload {workload!r}: chat or ids", 2)
    prompts, sampler, kind = WORKLOADS[workload]
    # the peer and the grid measure the engine in this process: they take it unless --engine says otherwise
    sampler, kind = sampling or sampler, engine_kind or ("inline" if peer or grid else kind)
    for name, value, choices in (
        ("--sampling", sampler, ("filters", "greedy")),
        ("--engine", kind, ("process", "inline")),
        ("--prompt-mix", prompt_mix, ("fixed", "chat")),
        ("--peer", peer or "hf", ("hf",)),
    ):
        if value not in choices:
            fail(f"unknown {name} {value!r}: {' or '.join(choices)}", 2)
    if (peer or grid) and kind != "inline":
        fail("--peer and --grid measure the engine in this process: leave out --engine process", 2)
    try:
        counts = [int(s) for s in (sessions or ("1,2,4,8,16,32,64" if scaling else "1,8,64")).split(",")]
    except ValueError:
        fail(f"--sessions takes counts separated by commas, like 1,8,64; got {sessions!r}", 2)
    if min(counts) < 1:
        fail("--sessions counts must be at least 1", 2)
    if grid and model is None:
        model = "synthetic:llama2-7b:fp16"
    from llamaterm.engine.workload import FILTERS, GREEDY

    mix = PromptMix.chat() if prompt_mix == "chat" else PromptMix.fixed(prompt, (64, 448))
    if url and not serve:
        fail("--url is the server --serve drives: add --serve", 2)
    if json_schema and serve:
        fail("--json-schema constrains the engine's replies: leave out --serve", 2)
    grammar = reply_grammar(json_schema, None, None)
    if speculate != "off":
        if serve or grid or peer or json_schema:
            fail("--speculate measures speculation alone: leave out --serve, --grid, --peer and --json-schema", 2)
        if speculate not in ("ngram", "draft") or (speculate == "draft") != (draft is not None):
            fail("--speculate takes ngram, or draft with --draft MODEL", 2)
        result = run_speculation(
            model,
            device,
            speculate,
            draft,
            speculate_tokens,
            [int(c) for c in (sessions or "1,8").split(",")],
            edit_texts,
            tokens,
            eager,
            kv_tokens,
            ctx,
        )
        typer.echo(json.dumps(result, indent=1) if as_json else format_speculation(result))
        return
    if serve:
        from llamaterm.app.serve_load import format_serve_load, run_serve_load

        result = run_serve_load(
            url,
            model=model,
            device=device,
            clients=max(counts),
            processes=processes,
            warmup_s=warmup,
            window_s=window,
            sampling=FILTERS if sampler == "filters" else GREEDY,
            prompts=mix,
            ctx=ctx,
        )
        typer.echo(json.dumps(result, indent=1) if as_json else format_serve_load(result))
        return
    what = Workload(prompts == "chat", FILTERS if sampler == "filters" else GREEDY, kind == "process", mix, grammar)
    result = run_bench(
        model, device, counts, what, grid, peer, tokens, prompt, window, warmup, eager, kv_tokens, ctx, repeat
    )
    typer.echo(json.dumps(result, indent=1) if as_json else format_tables(result))


@dataclass(frozen=True)
class Workload:
    chat: bool  # chat messages, else token-id prompts
    sampling: dict  # engine/workload.py's FILTERS or GREEDY
    process: bool  # the engine process, else the engine in this process
    mix: PromptMix  # for the closed loop
    grammar: Grammar | None = None  # every reply's (--json-schema)

    def describe(self) -> str:
        sampled = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.sampling.items() if k != "temperature")
        sampling = "greedy" if not self.sampling.get("temperature") else f"temperature {self.sampling['temperature']}"
        return (
            ("chat messages" if self.chat else "token-id prompts")
            + f", {sampling}{', ' + sampled if sampled and sampling != 'greedy' else ''}, "
            + ("through the engine process" if self.process else "the engine in this process")
            + (", replies under a JSON schema" if self.grammar else "")
        )


def open_client(model, device, config, process: bool):
    """(client, label, info): the engine in this process (engine/bench.py's Bench) or in its own, and what the
    tables need of it: weight bytes per step, start-up, CUDA graphs."""
    from llamaterm.engine import bench as wl

    if not process:
        b = wl.open_engine(model, device, config)
        return b, b.label, b.engine.core.describe()
    from dataclasses import replace

    from llamaterm.engine.serving.process import EngineProcess

    client = EngineProcess(replace(config, model=model, device=device))
    return client, client.model_name, client.info


def run_bench(
    model, device, counts, what: Workload, grid, peer, tokens, prompt_len, window, warmup, eager, kv_tokens, ctx, repeat
) -> dict:
    t = time.perf_counter()
    with interrupts_held():
        import torch

        from llamaterm.engine import bench as wl
        from llamaterm.engine.serving.device import resolve_device
    imports = time.perf_counter() - t

    progress = Progress(4 + 2 * len(counts) * repeat * (1 + bool(what.grammar)) + (peer is not None) + len(GRID) * grid)
    progress.step("loading the model")
    max_running = max(64, *counts) if not grid else 64
    kv = kv_tokens or (max(b for _, _, b in GRID) * (1024 + 256) if grid else None)
    config = EngineConfig(
        kv_tokens=kv, context_length=ctx, max_running=max_running, cuda_graphs=not eager, speculate="off"
    )
    dev = resolve_device(device)
    bw = wl.copy_bandwidth(dev)  # before the engine takes the memory
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    t = time.perf_counter()
    try:
        opened, label, info = open_client(model, device, config, what.process)
    except BaseException:
        progress.close()
        raise
    ready = time.perf_counter() - t
    inline = opened if not what.process else None
    client = inline.engine if inline else opened
    try:
        ctx = client.max_context
        vocab = client.vocab_size
        sessions = wl.Sessions(client, what.chat, what.sampling, vocab, grammar=what.grammar)
        t = time.perf_counter()
        list(sessions.start(8, 1).events())
        first = time.perf_counter() - t
        read = info["weight_bytes"]
        out = {
            "model": label,
            "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
            "workload": {
                "description": what.describe(),
                "chat": what.chat,
                "sampling": what.sampling,
                "engine": "process" if what.process else "inline",
                "prompt_mix": what.mix.__dict__,
            },
            "cuda_graphs": info["cuda_graphs"],
            "dense_weight_bytes": info["dense_weight_bytes"],
            "startup_s": {"imports": imports, **info["startup_s"], "first request": first},
            "ready_s": ready,
            "limit": {"weight_bytes_per_step": read, "copy_bandwidth_bytes_s": bw, "steps_per_s": bw / read},
        }
        # the limit: a decode step's weight bytes at the rate a device-to-device copy reads and writes bytes
        progress.step("serving while the CUDA graphs are captured")
        out["serve_first"] = serve_first(sessions, ready + first, max(counts), min(prompt_len, ctx // 2))

        progress.step("TTFT")
        ttft_len = min(512, ctx - 2)
        out["ttft"] = {"prompt_tokens": ttft_len, "ms": 1e3 * wl.ttft(sessions, ttft_len)}

        if inline:
            progress.step("launches per step")
            prompts = wl.Prompts(vocab)
            out["launches"] = {
                "decode": wl.launches_per_step(client, 1, 16, prompts),
                f"{prompt_len}-token prefill": wl.launches_per_step(client, prompt_len, 1, prompts),
            }

        # under a grammar, each run has a free twin just before it on the same engine: the two compare as one pair
        free = wl.Sessions(client, what.chat, what.sampling, vocab) if what.grammar else None
        kinds = [("free", free), ("schema", sessions)] if free else [("", sessions)]
        bases: dict[str, float] = {}
        rows = []
        limit = out["limit"]["steps_per_s"]
        for n, _, (replies, runs) in itertools.product(counts, range(repeat), kinds):
            said = f", {replies}" if replies else ""
            progress.step(f"static batch, {n} sessions{said}")
            static = wl.static_rate(runs, n, min(prompt_len, ctx - tokens - 1), tokens)
            base = bases.setdefault(replies, static / counts[0])
            progress.step(f"closed loop, {n} sessions{said} ({warmup + window:.0f} s)")
            loop = wl.closed_loop(runs, n, what.mix, warmup, window)
            rows.append(
                {
                    "sessions": n,
                    "replies": replies,
                    "static_tok_s": static,
                    "vs_one_session": static / base if base else None,
                    "static_pct_of_limit": 100 * static / n / limit,
                    "dynamic_tok_s": loop["tok_s"],
                    "dynamic_vs_static": loop["tok_s"] / static if static else None,
                    "dynamic_pct_of_limit": 100 * loop["tok_s"] / n / limit,
                    **{k: v for k, v in loop.items() if k != "tok_s"},
                }
            )
        out["decode"] = rows

        if peer == "hf":
            assert inline is not None  # bench() sends --peer to the engine in this process
            progress.step("Hugging Face transformers, one session, 3 runs")
            prompts = wl.Prompts(vocab)
            same = [prompts(min(prompt_len, ctx - tokens - 1)) for _ in range(3)]
            ours, theirs = wl.our_greedy_runs(inline, same, tokens), wl.hf_greedy_runs(inline, same, tokens)
            import statistics

            median = lambda xs: statistics.median(xs)
            side = lambda r: {
                "tok_s": median(r.tok_s),
                "runs_tok_s": r.tok_s,
                "ttft_ms": 1e3 * median(r.ttft_s),
                "load_s": r.load_s,
            }
            out["peer"] = {
                "name": "Hugging Face transformers",
                "tokens": tokens,
                "prompt_tokens": len(same[0]),
                "ours": side(ours),
                "peer": side(theirs),
                "speedup": median(ours.tok_s) / median(theirs.tok_s),
                "same_tokens": ours.tokens == theirs.tokens if inline.path else None,
            }
        if grid:
            cells = []
            prompts = wl.Prompts(vocab)
            for i, o, n in GRID:
                progress.step(f"grid: input {i}, output {o}, batch {n}")
                cells.append(wl.grid_cell(client, n, i, o, prompts))
            out["grid"] = cells
    finally:
        progress.close()
        client.shutdown()
    return out


def serve_first(sessions, first_answer_s: float, n: int, prompt_len: int) -> dict | None:
    """Serve first, capture later: the first answer's time after the imports (loading, warm-up, the request),
    then n sessions for 15 s from start-up while the CUDA graphs are captured between their steps
    (engine/bench.py graphs_timeline), and the wait for those captured once the engine idles. None without graphs.
    """
    from llamaterm.engine import bench as wl

    stats = sessions.step_stats()
    if not (stats.graphs_ready_s or stats.graphs_pending):
        return None
    timeline = wl.graphs_timeline(sessions, n, prompt_len, 15.0)
    return {"first_answer_s": first_answer_s, **timeline, "idle_captures_s": wl.wait_for_graphs(sessions)}


def format_serve_first(s: dict | None) -> list[str]:
    if s is None:
        return []
    ready = ", ".join(f"{bucket} {t:.2f}" for bucket, t in sorted(s["graphs_ready_s"].items()))
    full = "-" if s["full_graph_speed_s"] is None else f"{s['full_graph_speed_s']:.2f} s"
    ratio = s["max_step_background_ms"] / s["normal_step_ms"] if s["normal_step_ms"] else float("nan")
    return [
        f"first answer {s['first_answer_s']:.2f} s after the imports; {s['sessions']} sessions from start-up, "
        f"at full graph speed {full} after the engine was ready",
        f"graphs ready (step tokens: s after ready): {ready}; {s['pending_after']} more once idle "
        f"({s['idle_captures_s']:.2f} s)",
        f"longest graph decode step beside the captures {s['max_step_background_ms']:.1f} ms, a normal step "
        f"{s['normal_step_ms']:.1f} ms ({ratio:.1f}x); the captures' longest turn beside a graph step "
        f"{s['max_background_turn_ms']:.1f} ms, their slowest piece {s['slowest_piece'][0]:.1f} ms "
        f"({s['slowest_piece'][1]})",
    ]


def format_tables(r: dict) -> str:
    lim = r["limit"]
    lines = [
        f"llamaterm bench: {r['model']} on {r['device']}"
        + (", no CUDA graphs" if r["device"].startswith("cuda") and not r["cuda_graphs"] else ""),
        f"workload: {r['workload']['description']}",
        f"weights read per step {lim['weight_bytes_per_step'] / 1e9:.3f} GB; copy bandwidth "
        f"{lim['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s (read + write): at most {lim['steps_per_s']:,.0f} "
        "decode steps/s",
        "",
        f"start-up: {startup_split(r['startup_s'])}; the engine was ready {r['ready_s']:.2f} s after the imports",
        f"TTFT, {r['ttft']['prompt_tokens']}-token prompt: {r['ttft']['ms']:.1f} ms",
        *format_serve_first(r.get("serve_first")),
    ]
    for kind, la in r.get("launches", {}).items():
        if la:
            lines.append(
                f"per {kind} step: {la['launches_per_step']:.1f} launches, {la['kernels_per_step']:.0f} "
                f"kernels ({la['steps']} steps profiled)"
            )
    lines.append("")
    paired = any(row.get("replies") for row in r["decode"])
    lines.append(
        f"{'sessions':>8} {'replies ' if paired else ''}{'static tok/s':>13} {'vs 1':>6} {'% limit':>8} "
        f"{'dynamic tok/s':>14} {'dyn/static':>11} {'gap p50 ms':>11} {'p99':>6} {'max':>6} {'steps/s':>8} "
        f"{'host ms':>8}"
    )
    for row in r["decode"]:
        vs_one = "    -" if row["vs_one_session"] is None else f"{row['vs_one_session']:5.2f}"  # no tokens seen
        ratio = "         -" if row["dynamic_vs_static"] is None else f"{100 * row['dynamic_vs_static']:10.0f}"
        gap = row["gap_ms"]
        per_step = f" {row['steps_per_s']:8,.0f} {row['host_ms_per_step']:8.2f}" if "steps_per_s" in row else ""
        replies = f"{row.get('replies', ''):7} " if paired else ""
        lines.append(
            f"{row['sessions']:8d} {replies}{row['static_tok_s']:13,.1f} {vs_one}x {row['static_pct_of_limit']:7.0f}% "
            f"{row['dynamic_tok_s']:14,.1f} {ratio}% {gap['p50']:11.1f} {gap['p99']:6.1f} {gap['max']:6.1f}" + per_step
        )
    for row in r["decode"]:
        if m := row.get("masks_ms_per_step"):
            lines.append(
                f"{row['sessions']:8d} sessions, a step's grammar masks: ready in {m['fill']:.2f} ms on their thread; "
                f"the engine waited {m['tokens']:.2f} ms for the tokens they start from and {m['wait']:.2f} ms for "
                f"them; {100 * row.get('forced_share', 0):.0f}% of the tokens forced by the grammar, computed unsampled"
            )
    if paired:
        pairs = list(zip(r["decode"][::2], r["decode"][1::2], strict=True))
        share = lambda key: ", ".join(f"{100 * b[key] / a[key]:.0f}%" if a[key] else "-" for a, b in pairs)
        lines.append(
            f"under the schema, pair by pair, % of free: static {share('static_tok_s')}; closed loop "
            f"{share('dynamic_tok_s')}"
        )
    mix = r["workload"]["prompt_mix"]
    spans = ", ".join(f"{lo}-{hi} ({100 * w:.0f}%)" if lo != hi else f"{lo}" for w, lo, hi in mix["prompts"])
    lines.append(
        f"dynamic: a closed loop, prompts of {spans} {'words' if r['workload']['chat'] else 'tokens'}, each session "
        f"ends after {mix['outputs'][0]}-{mix['outputs'][1]} tokens and a new one takes its place; gap: a session's "
        "time between two tokens; host ms: the engine loop's time a step outside its waits for the GPU"
    )
    if "peer" in r:
        p = r["peer"]
        same = "" if p["same_tokens"] is None else f"; same tokens: {p['same_tokens']}"
        lines += [
            "",
            f"one session, {p['prompt_tokens']}-token prompts, {p['tokens']} new tokens, medians of 3 runs:",
            f"{'':28}{'tok/s':>9} {'TTFT ms':>8} {'load s':>7}   runs (tok/s)",
        ]
        for name, side in (("llamaterm", p["ours"]), (p["name"], p["peer"])):
            lines.append(
                f"{name:28}{side['tok_s']:9,.1f} {side['ttft_ms']:8.0f} {side['load_s']:7.2f}   "
                + " ".join(f"{x:.1f}" for x in side["runs_tok_s"])
            )
        lines.append(f"speed-up {p['speedup']:.2f}x{same}")
    if "grid" in r:
        lines += [
            "",
            f"{'in':>5} {'out':>4} {'batch':>5} {'batch s':>8} {'ms/token':>9} {'tok/s':>9} "
            f"{'TFLOP/s':>8} {'alloc GB':>9} {'reserved GB':>12}",
        ]
        for c in r["grid"]:
            mem = (
                f"{c['peak_allocated_gb']:9.1f} {c['peak_reserved_gb']:12.1f}"
                if c["peak_allocated_gb"]
                else f"{'-':>9} {'-':>12}"
            )
            lines.append(
                f"{c['input']:5d} {c['output']:4d} {c['batch']:5d} {c['seconds']:8.2f} "
                f"{c['ms_per_token']:9.2f} {c['tok_s']:9,.0f} {c['tflop_s']:8.1f} {mem}"
            )
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.command()(bench)


def run_speculation(
    model, device, speculate, draft, speculate_tokens, counts, edit_texts: Path, max_tokens, eager, kv_tokens, ctx
) -> dict:
    """`--speculate`'s comparison, on the engine in this process (engine/bench.py's speculation_table)."""
    texts = sorted(edit_texts.glob("*.txt")) if edit_texts.is_dir() else []
    if not texts:
        fail(f"--edit-texts {edit_texts}: no *.txt texts there: run from the repository, or give a folder", 2)
    with interrupts_held():
        from llamaterm.engine import bench as wl
        from llamaterm.engine.api import EngineConfig
    edits = [wl.EditText.read(p.name, p.read_text()) for p in texts]
    progress = Progress(1 + 4 * len(counts))
    progress.step("loading the model")
    config = EngineConfig(
        kv_tokens=kv_tokens,
        context_length=ctx,
        max_running=max(64, *counts),
        cuda_graphs=not eager,
        speculate=speculate,
        draft=draft,
        speculate_tokens=speculate_tokens,
    )
    try:
        opened = wl.open_engine(model, device, config)
        try:
            rows = wl.speculation_table(opened.engine, speculate, counts, edits, max_tokens, progress.step)
        finally:
            opened.engine.shutdown()
    finally:
        progress.close()
    return {
        "model": opened.label,
        "device": opened.engine.device,
        "speculate": speculate,
        "draft": draft,
        "speculate_tokens": speculate_tokens,
        "max_tokens": max_tokens,
        "edit_texts": [e.name for e in edits],
        "rows": rows,
    }


def format_speculation(r: dict) -> str:
    kind = "prompt lookup" if r["speculate"] == "ngram" else f"draft model {r['draft']}"
    lines = [
        f"llamaterm bench: {r['model']} on {r['device']}, speculative decoding ({kind}, drafts while a step samples "
        f"at most {r['speculate_tokens']} rows), replies of at most {r['max_tokens']} tokens",
        f"editing: {', '.join(r['edit_texts'])} with a name changed; open chat: 4 questions; sampled: temperature "
        "0.8, top-k 40, top-p 0.95, min-p 0.05, seed i for session i",
        "",
        f"{'workload':10} {'sampling':8} {'sessions':>8} {'off tok/s':>10} {'on tok/s':>10} {'speed-up':>8} "
        f"{'accepted':>8} {'tok/step':>8} {'steps off/on':>13} {'drafting':>8} {'serial':>6} {'same':>5}",
    ]
    for row in r["rows"]:
        accepted = "-" if row["acceptance"] is None else f"{100 * row['acceptance']:.0f}%"
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(
            f"{row['workload']:10} {row['sampling']:8} {row['sessions']:8d} {row['off_tok_s']:10,.1f} "
            f"{row['on_tok_s']:10,.1f} {speedup:>8} {accepted:>8} {row['tokens_per_step']:8.2f} "
            f"{'/'.join(map(str, row['steps'])):>13} {row['draft_steps']:8d} {row['serial_steps']:6d} "
            f"{'yes' if row['same_tokens'] else 'NO':>5}"
        )
    lines.append(
        "tok/s: all sessions' tokens after their first, over the time from the first token to the last; accepted: "
        "drafts kept; tok/step: tokens per engine step (the sessions' together); steps: the engine's steps without and "
        "with speculation; drafting: of those with, the steps that verified drafts; serial: the steps completed "
        "before the next was scheduled (the overlap given up for drafts); same: the replies with speculation are the "
        "tokens of those without"
    )
    return "\n".join(lines)
