"""A reply's events read to the end, as `run` and the line chat show them: the answer streamed to stdout, the
thinking to stderr (dimmed on a terminal), and the rate after it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import typer

from llamaterm.app.console import fail, say
from llamaterm.app.terminal import TerminalStream


@dataclass
class Reply:
    text: str  # the answer: the reply less its thinking
    token_ids: list[int]
    finish_reason: str | None
    thinking: str | None = None  # what the model wrote between <think> and </think>, if it thinks
    logprobs: list = field(default_factory=list)  # TokenLogprob of each reply token, when asked for


def collect(handle, echo: bool = False, hide_thinking: bool = False, fatal: bool = True) -> Reply:
    """Read a request's events to the end; with echo, stream the answer to stdout as it arrives, and the
    thinking (unless hidden) to stderr. A request that fails exits (fatal), or says so and ends with the
    finish reason "error" (a chat goes on: a server refuses a prompt over the context in its events)."""
    reply = Reply("", [], None)
    out, thought = TerminalStream(sys.stdout), TerminalStream(sys.stderr)
    for event in handle.events():
        if event.error:
            if fatal:
                fail(f"generation failed: {event.error}")
            say(f"llamaterm: generation failed: {event.error}")
            reply.finish_reason = "error"
            return reply
        if event.thinking and not hide_thinking:
            reply.thinking = (reply.thinking or "") + event.thinking
            if echo:
                show_thinking(thought.push(event.thinking))
        if event.answer and echo:
            if reply.thinking and not reply.text:
                show_thinking("\n")  # the answer starts on a line of its own
            sys.stdout.write(out.push(event.answer))
            sys.stdout.flush()
        reply.text += event.answer
        reply.token_ids += event.token_ids
        reply.logprobs += event.logprobs
        reply.finish_reason = event.finish_reason
    if echo:
        show_thinking(thought.flush())
        sys.stdout.write(out.flush() + "\n")
    return reply


def show_thinking(text: str) -> None:
    """Thinking goes to stderr, dimmed on a terminal."""
    if text:
        sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if sys.stderr.isatty() else text)
        sys.stderr.flush()


def report(handle) -> None:
    st = handle.stats()
    ttft = f"{st.ttft_s:.2f}" if st.ttft_s is not None else "-"
    typer.echo(f"[{st.generated_tokens} tokens, {st.tokens_per_s:.1f} tok/s, TTFT {ttft} s]", err=True)
