"""`llamaterm bench`: the engine's speed on this machine, beside the limit (and a peer) measured in the same run.

app/cli.py calls register(app). torch and the engine load inside the command. Tables go to stdout (or one JSON
object with --json); the progress bar to stderr. The workloads live in engine/bench.py.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Annotated

import typer

GRID = [(i, o, b) for i in (128, 512, 1024) for o in (128, 256) for b in (16, 32, 64)]


class Progress:
    """One line on stderr, when it is a terminal: [#####.....] 3/12 what is running now."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.shown = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.shown:
            return
        width = 24
        fill = width * (self.done - 1) // max(1, self.total)
        sys.stderr.write(f"\r\033[K[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {what}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def bench(
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help=(
                "Model name in the store, a path, or synthetic:NAME, random 4-bit weights in a model's shapes (NAME: "
                "llama3-8b, llama2-7b, smollm2-135m, qwen2.5-7b, gemma3-4b, gemma3-12b, tiny; add :fp16 for fp16)."
            ),
        ),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    sessions: Annotated[
        str | None, typer.Option(help="Session counts, e.g. 1,8,64 (default: 1,8,64; with --scaling 1,2,4,8,16,32,64).")
    ] = None,
    scaling: Annotated[
        bool,
        typer.Option("--scaling", help="Static batch vs sessions that come and go (a closed loop), per session count."),
    ] = False,
    grid: Annotated[
        bool,
        typer.Option(
            "--grid", help="The ColossalAI / vLLM table: input 128/512/1024 x output 128/256 x batch 16/32/64."
        ),
    ] = False,
    peer: Annotated[
        str | None, typer.Option(help="hf: Hugging Face transformers on the same model, one session, three runs each.")
    ] = None,
    tokens: Annotated[int, typer.Option(min=2, help="New tokens per session in static batches.")] = 128,
    prompt: Annotated[int, typer.Option(min=1, help="Prompt tokens per session.")] = 128,
    window: Annotated[float, typer.Option(min=0.1, help="Seconds the closed loop is measured for.")] = 10.0,
    warmup: Annotated[float, typer.Option(min=0.0, help="Seconds the closed loop runs before that.")] = 3.0,
    eager: Annotated[bool, typer.Option("--eager", help="No CUDA graphs: launch every kernel.")] = False,
    kv_tokens: Annotated[int | None, typer.Option(min=16, help="KV cache pool size in tokens.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
):
    """Measure decode tok/s by sessions, TTFT, start-up and launches per step, against the weight-read limit.

    Examples:

      llamaterm bench --model synthetic:llama3-8b --scaling

      llamaterm bench --device cpu --peer hf --sessions 1
    """
    from llamaterm.app.cli import fail

    if peer not in (None, "hf"):
        fail(f"unknown peer {peer!r}: the one peer is hf (Hugging Face transformers)", 2)
    try:
        counts = [int(s) for s in (sessions or ("1,2,4,8,16,32,64" if scaling else "1,8,64")).split(",")]
    except ValueError:
        fail(f"--sessions takes counts separated by commas, like 1,8,64; got {sessions!r}", 2)
    if min(counts) < 1:
        fail("--sessions counts must be at least 1", 2)
    if grid and model is None:
        model = "synthetic:llama2-7b:fp16"
    result = run_bench(model, device, counts, scaling, grid, peer, tokens, prompt, window, warmup, eager, kv_tokens)
    typer.echo(json.dumps(result, indent=1) if as_json else format_tables(result))


def run_bench(model, device, counts, scaling, grid, peer, tokens, prompt_len, window, warmup, eager, kv_tokens) -> dict:
    from llamaterm.app.cli import interrupts_held

    t = time.perf_counter()
    with interrupts_held():
        import torch

        from llamaterm.engine import bench as wl
        from llamaterm.engine.api import EngineConfig
    imports = time.perf_counter() - t

    progress = Progress(3 + len(counts) * (1 + scaling) + scaling + (peer is not None) + len(GRID) * grid)
    progress.step("loading the model")
    max_running = max(64, *counts) if not grid else 64
    kv = kv_tokens or (max(b for _, _, b in GRID) * (1024 + 256) if grid else None)
    config = EngineConfig(kv_tokens=kv, max_running=max_running, cuda_graphs=not eager)
    try:
        b = wl.open_engine(model, device, config)
    except BaseException:
        progress.close()
        raise
    engine = b.engine
    try:
        dev = engine.model.device
        ctx = engine.max_context
        prompts = wl.Prompts(engine.model.config.vocab_size)
        t = time.perf_counter()
        engine.generate(None, wl.SamplingParams(max_tokens=1, ignore_eos=True), prompt_ids=prompts(8))
        first = time.perf_counter() - t
        read, bw = wl.weight_bytes(engine.model), wl.copy_bandwidth(dev)
        out = {
            "model": b.label,
            "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
            "cuda_graphs": engine.runner.graphs is not None,
            "dense_weight_bytes": engine.dense_weight_bytes,
            "startup_s": {"imports": imports, **engine.startup_s, "first request": first},
            "limit": {"weight_bytes_per_step": read, "copy_bandwidth_bytes_s": bw, "steps_per_s": bw / read},
        }
        # the limit counts the step's weight bytes at the copy rate (anchors.md's convention)

        progress.step("TTFT")
        ttft_len = min(512, ctx - 2)
        out["ttft"] = {"prompt_tokens": ttft_len, "ms": 1e3 * wl.ttft(engine, ttft_len, prompts)}

        progress.step("launches per step")
        out["launches"] = {
            "decode": wl.launches_per_step(engine, 1, 16, prompts),
            f"{prompt_len}-token prefill": wl.launches_per_step(engine, prompt_len, 1, prompts),
        }

        base, rows = None, []
        for n in counts:
            progress.step(f"static batch, {n} sessions")
            static = wl.static_rate(engine, n, min(prompt_len, ctx - tokens - 1), tokens, prompts)
            base = base or static / counts[0]
            row = {
                "sessions": n,
                "static_tok_s": static,
                "vs_one_session": static / base if base else None,
                "static_pct_of_limit": 100 * static / n / out["limit"]["steps_per_s"],
            }
            if scaling:
                progress.step(f"closed loop, {n} sessions ({warmup + window:.0f} s)")
                p = min(prompt_len, ctx - 449)
                dynamic, max_step = wl.closed_loop_rate(engine, n, (p, p), warmup, window, prompts)
                row |= {
                    "dynamic_tok_s": dynamic,
                    "dynamic_vs_static": dynamic / static if static else None,
                    "dynamic_pct_of_limit": 100 * dynamic / n / out["limit"]["steps_per_s"],
                    "dynamic_max_step_ms": 1e3 * max_step,
                }
            rows.append(row)
        out["decode"] = rows
        if scaling:  # the longest step when prompts of any length arrive: a compile would show here
            n, longest = counts[min(1, len(counts) - 1)], min(2000, ctx - 449)
            progress.step(f"closed loop, {n} sessions, prompts of 1-{longest} tokens")
            dynamic, max_step = wl.closed_loop_rate(engine, n, (1, longest), warmup, window, prompts)
            out["varied_prompts"] = {
                "sessions": n,
                "prompt_tokens": [1, longest],
                "dynamic_tok_s": dynamic,
                "max_step_ms": 1e3 * max_step,
            }

        if peer == "hf":
            progress.step("Hugging Face transformers, one session, 3 runs")
            same = [prompts(min(prompt_len, ctx - tokens - 1)) for _ in range(3)]
            ours, theirs = wl.our_greedy_runs(b, same, tokens), wl.hf_greedy_runs(b, same, tokens)
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
                "same_tokens": ours.tokens == theirs.tokens if b.path else None,
            }
        if grid:
            cells = []
            for i, o, n in GRID:
                progress.step(f"grid: input {i}, output {o}, batch {n}")
                cells.append(wl.grid_cell(engine, n, i, o, prompts))
            out["grid"] = cells
    finally:
        progress.close()
        engine.shutdown()
    return out


def format_tables(r: dict) -> str:
    lim = r["limit"]
    lines = [
        f"llamaterm bench: {r['model']} on {r['device']}"
        + (", no CUDA graphs" if r["device"].startswith("cuda") and not r["cuda_graphs"] else ""),
        f"weights read per step {lim['weight_bytes_per_step'] / 1e9:.3f} GB; copy bandwidth "
        f"{lim['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s (read + write): at most {lim['steps_per_s']:,.0f} "
        "decode steps/s",
        "",
        "start-up: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in r["startup_s"].items())
        + f" (total {sum(r['startup_s'].values()):.2f} s)",
        f"TTFT, {r['ttft']['prompt_tokens']}-token prompt: {r['ttft']['ms']:.1f} ms",
    ]
    for kind, la in r["launches"].items():
        if la:
            lines.append(
                f"per {kind} step: {la['launches_per_step']:.1f} launches, {la['kernels_per_step']:.0f} "
                f"kernels ({la['steps']} steps profiled)"
            )
    lines.append("")
    dynamic = "dynamic_tok_s" in r["decode"][0]
    head = f"{'sessions':>8} {'static tok/s':>13} {'vs 1':>6} {'% limit':>8}"
    if dynamic:
        head += f" {'dynamic tok/s':>14} {'dyn/static':>11} {'% limit':>8} {'max step ms':>12}"
    lines.append(head)
    for row in r["decode"]:
        vs_one = "    -" if row["vs_one_session"] is None else f"{row['vs_one_session']:5.2f}"  # no tokens seen
        line = f"{row['sessions']:8d} {row['static_tok_s']:13,.1f} {vs_one}x {row['static_pct_of_limit']:7.0f}%"
        if dynamic:
            ratio = "         -" if row["dynamic_vs_static"] is None else f"{100 * row['dynamic_vs_static']:10.0f}"
            line += (
                f" {row['dynamic_tok_s']:14,.1f} {ratio}% "
                f"{row['dynamic_pct_of_limit']:7.0f}% {row['dynamic_max_step_ms']:12.1f}"
            )
        lines.append(line)
    if dynamic:
        lines.append("dynamic: a closed loop, each session ends after 64-448 tokens and a new one takes its place")
        v = r["varied_prompts"]
        lines.append(
            f"closed loop of {v['sessions']} sessions, prompts of {v['prompt_tokens'][0]}-"
            f"{v['prompt_tokens'][1]} tokens: {v['dynamic_tok_s']:,.1f} tok/s, longest step "
            f"{v['max_step_ms']:.1f} ms"
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
