"""Does the TUI slow the engine? The same N streaming sessions, once with nothing attached and once through the
headless TUI (every pane rendering Markdown), compared by aggregate tokens/s; plus keystroke latency while
the panes stream.

    python -m tests.benchmarks.tui_bench [--model M] [--device D] [--sessions 8] [--max-tokens 128] [--repeats 3]
        [--token-probs]

--token-probs turns on the panes' Token probs: requests ask for logprobs, and replies are drawn as shaded tokens.

Both runs submit the same greedy request, so they generate the same tokens. Aggregate tokens/s = all generated
tokens / (last finish - first submit), from the engine's request stats, so UI timing plays no part in it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from textual import events
from textual.pilot import Pilot

if TYPE_CHECKING:
    from llamaterm.app.tui.widgets.prompt_input import PromptInput

PROMPT = "Explain how a hash map works, with a short Python example."
TARGET = 0.95
KEY_LATENCY_BOUND_S = 0.1


@dataclass
class Recorder:
    """Wraps an engine and remembers each request's handle and submit time, for the throughput figure."""

    engine: object
    requests: list[tuple[float, object]] = field(default_factory=list)

    def submit(self, *args, **kwargs):
        start = time.perf_counter()
        handle = self.engine.submit(*args, **kwargs)
        self.requests.append((start, handle))
        return handle

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def shutdown(self) -> None:
        """The app shuts its engine down on exit; the bench reuses this one for the next run."""

    def finished(self) -> bool:
        return bool(self.requests) and all(h.stats().finished for _, h in self.requests)

    def tokens_per_s(self) -> tuple[float, int]:
        stats = [(start, h.stats()) for start, h in self.requests]
        first = min(start for start, _ in stats)
        last = max(start + s.elapsed_s for start, s in stats)
        tokens = sum(s.generated_tokens for _, s in stats)
        return tokens / (last - first), tokens


async def key_latencies(pilot: Pilot, target: PromptInput, keys: str) -> list[float]:
    """Seconds from each key event reaching the app to the input holding the character; the keys go through
    the app's queue as a terminal's would, so a busy UI loop shows up as latency."""
    app = pilot.app
    latencies = []
    for char in keys:
        before = target.value
        start = time.perf_counter()
        app.post_message(events.Key(char, char))
        while target.value == before:
            if time.perf_counter() - start > 5:
                raise RuntimeError(f"the key {char!r} was not handled within 5 s")
            await asyncio.sleep(0.001)
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)  # a fast typist
    return latencies


def headless_run(engine, sessions: int, settings) -> float:
    recorder = Recorder(engine)
    messages = [{"role": "user", "content": PROMPT}]
    handles = [recorder.submit(messages, settings.sampling_params(engine.sampling_defaults)) for _ in range(sessions)]
    for handle in handles:
        for _ in handle.events():
            pass
    return recorder.tokens_per_s()[0]


def tui_run(engine, sessions: int, settings, typing: bool = False) -> tuple[float, float, list[float]]:
    """The same requests sent from the TUI's broadcast input. Returns (aggregate tokens/s, the UI thread's busy
    share while the replies streamed, key latencies in s: with `typing`, keys go to a pane's input meanwhile)."""
    from llamaterm.app.tui.app import ChatApp
    from llamaterm.app.tui.widgets.prompt_input import PromptInput

    recorder = Recorder(engine)
    app = ChatApp(lambda *_: recorder, sessions=sessions)
    latencies: list[float] = []
    busy = 0.0

    async def scenario(pilot: Pilot) -> None:
        nonlocal busy
        while app.chat.engine is None:
            await pilot.pause(0.01)
        for pane in app.chat.panes:
            pane.session.configure(settings)
        app.chat.query_one("#prompt", PromptInput).load_text(PROMPT)
        wall, cpu = time.perf_counter(), time.thread_time()
        await pilot.press("enter")
        target = app.chat.panes[0].query_one(".pane-input", PromptInput)
        target.focus()
        while not recorder.finished():
            streaming = all(p.session.messages[-1].content for p in app.chat.panes)
            if typing and streaming and len(latencies) < 40:
                latencies.extend(await key_latencies(pilot, target, "abcdefghij"))
            else:
                await asyncio.sleep(0.25)  # this loop runs on the UI thread too: it checks rarely
        busy = (time.thread_time() - cpu) / (time.perf_counter() - wall)

    async def main() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await scenario(pilot)

    asyncio.run(main())
    return recorder.tokens_per_s()[0], busy, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--token-probs", action="store_true")
    args = parser.parse_args()

    from llamaterm.app.tui.session import ChatSettings
    from llamaterm.engine.api import EngineConfig
    from llamaterm.engine.serving.process import EngineProcess
    from llamaterm.engine.store.model_store import resolve_model

    model = resolve_model(args.model)
    os.environ["LLAMATERM_HOME"] = tempfile.mkdtemp(prefix="llamaterm-bench-")  # keep the user's history clean
    engine = EngineProcess(EngineConfig(model=str(model), device=args.device))
    settings = ChatSettings(max_tokens=args.max_tokens, token_probabilities=args.token_probs)
    print(f"{model.name} on {engine.device}: {args.sessions} sessions x {args.max_tokens} tokens, greedy")
    headless_run(engine, 1, ChatSettings(max_tokens=8))  # warm-up
    headless, with_tui = [], []
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits both alike
        headless.append(headless_run(engine, args.sessions, settings))
        rate, busy, _ = tui_run(engine, args.sessions, settings)
        with_tui.append(rate)
        print(f"  headless {headless[-1]:6.1f} tok/s   with the TUI {rate:6.1f} tok/s (UI thread busy {busy:.0%})")
    ratio = statistics.median(with_tui) / statistics.median(headless)
    print(
        f"median: headless {statistics.median(headless):.1f} tok/s, with the TUI {statistics.median(with_tui):.1f}"
        f" tok/s = {ratio:.1%} (target >= {TARGET:.0%}): {'PASS' if ratio >= TARGET else 'FAIL'}"
    )

    _, _, latencies = tui_run(engine, args.sessions, settings, typing=True)
    engine.shutdown()
    latencies.sort()
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    verdict = "PASS" if p95 <= KEY_LATENCY_BOUND_S else "FAIL"
    print(
        f"keys typed while {args.sessions} panes stream ({len(latencies)} keys): median"
        f" {ms(statistics.median(latencies))}, p95 {ms(p95)}, max {ms(latencies[-1])}"
        f" (p95 bound {ms(KEY_LATENCY_BOUND_S)}): {verdict}"
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


if __name__ == "__main__":
    main()
