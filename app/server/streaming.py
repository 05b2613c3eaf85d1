"""A response's events, from the engine's thread-safe queues to the client. One pump task moves them onto asyncio
queues every PUMP_S, so a waiting stream holds no thread and the event loop never blocks; a streamed response goes
as server-sent events, a whole one once every choice has ended. A client that disconnects cancels its request, which
frees its KV blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llamaterm.app.openai_shapes import Responder
from llamaterm.app.server.errors import APIError, shutting_down
from llamaterm.engine.api import EngineClient, Event, RequestStream, TokenLogprob, ToolCallDelta, whole_calls
from llamaterm.engine.errors import LlamatermError

PUMP_S = 0.01  # how often the live requests' events are collected (the engine process sends one message per step)
DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request looks for a client that left
DONE = "data: [DONE]\n\n"
Events = asyncio.Queue[tuple[int, list[Event]]]  # a response's events: (its choice's index, the events that came)


@dataclass(eq=False)
class Choice:
    """One of a response's n choices, as its events arrive: its own request to the engine, and its reply so far
    (its content and its calls' pieces, as the engine read them: Event)."""

    stream: RequestStream
    content: list[str] = dataclasses.field(default_factory=list)
    calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0  # in a stream, the text offset of its next token's log-probabilities
    finish_reason: str | None = None

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a reply that ended with calls."""
        return "tool_calls" if reason == "stop" and self.calls else reason


class EventPump:
    """Moves every live request's events from its thread-safe queue to an asyncio queue, a batch per poll."""

    def __init__(self) -> None:
        self.live: dict[RequestStream, tuple[Events, int]] = {}
        self.wake = asyncio.Event()
        self.closed = False  # the server is stopping: its last requests have ended

    def watch(self, streams: list[RequestStream]) -> Events:
        """One queue for a response's streams (its n choices): (the stream's index, its new events)."""
        if self.closed:
            raise shutting_down()
        queue: Events = asyncio.Queue()
        for i, stream in enumerate(streams):
            self.live[stream] = queue, i
        self.wake.set()
        return queue

    def end_all(self) -> None:
        """Ends every live request now, as cancelled by the server's stop, and watches no more."""
        self.closed = True
        for stream, (queue, i) in self.live.items():
            queue.put_nowait((i, [Event(stream.id, finished=True, finish_reason="cancelled")]))
        self.live.clear()

    async def run(self) -> None:
        while True:
            if not self.live:
                await self.wake.wait()
                self.wake.clear()
            for stream, (queue, i) in list(self.live.items()):
                events = stream.poll()
                if events:
                    queue.put_nowait((i, events))
                    if events[-1].finished:
                        del self.live[stream]
            await asyncio.sleep(PUMP_S)


def cancel_all(engine: EngineClient, streams: list[RequestStream]) -> None:
    """Cancel those still running (a response's choices)."""
    for stream in streams:
        if stream.stats().finished:
            continue
        try:
            engine.cancel(stream)
        except LlamatermError:  # the engine has exited: the request ended with it
            pass


def usage(streams: list[RequestStream]) -> dict:
    """The prompt once (as OpenAI counts n choices), the completions of every choice."""
    first, generated = streams[0].stats(), sum(s.stats().generated_tokens for s in streams)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def failure(event: Event) -> APIError | None:
    """A request that ended without a reply of its own: the engine failed it or is shutting down."""
    if event.error:
        return APIError(500, f"generation failed: {event.error}", kind="server_error")
    if event.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", kind="server_error")
    return None


def joined(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """A chunk's call pieces, those of one call that follow each other as one (the tokens of a poll go as one
    chunk)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1] = dataclasses.replace(out[-1], arguments=out[-1].arguments + d.arguments)
        else:
            out.append(d)
    return out


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EngineStreamResponse(StreamingResponse):
    """Server-sent events of one request; however the response ends (a client that left, a server stopping),
    a request still running is cancelled."""

    def __init__(self, content: AsyncIterator[str], engine: EngineClient, streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.engine, self.streams = engine, streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_all(self.engine, self.streams)


async def stream_events(
    queue: Events, choices: list[Choice], responder: Responder, include_usage: bool
) -> AsyncIterator[str]:
    extra: dict[str, Any] = {"usage": None} if include_usage else {}  # usage: null in every chunk but the last
    yield "".join(sse(responder.chunk("", role=True, index=i, **extra)) for i in range(len(choices)))
    running = len(choices)
    while running:
        i, events = await queue.get()
        choice, last = choices[i], events[-1]
        # the tokens that arrived since the last poll go as one chunk: at tens of thousands of tokens a second,
        # a chunk per token would cost the server more than the engine
        text = "".join(e.content for e in events)
        logprobs = [lp for e in events for lp in e.logprobs]
        ids = [t for e in events for t in e.token_ids]
        if last.finished and (error := failure(last)) is not None:
            yield (sse(responder.chunk(text, index=i, ids=ids, **extra)) if text else "") + sse(error.body) + DONE
            return
        deltas = [d for e in events for d in e.tool_calls]
        choice.calls += deltas
        reason = choice.finish(last.finish_reason) if last.finished else None
        if text or deltas or logprobs or reason or (ids and responder.token_ids):
            at = choice.offset  # (a token's text may come in a later chunk: a stop string held it back)
            calls = [d.openai() for d in joined(deltas)]
            yield sse(
                responder.chunk(text, reason, calls=calls, index=i, logprobs=logprobs, offset=at, ids=ids, **extra)
            )
        if logprobs:
            choice.offset += responder.text_length(logprobs)
        running -= last.finished
    if include_usage:
        yield sse(responder.envelope(responder.chunk_kind, [], usage=usage([c.stream for c in choices])))
    yield DONE


async def whole_reply(
    request: Request,
    engine: EngineClient,
    queue: Events,
    choices: list[Choice],
    responder: Responder,
    asked: bool,
    reads_calls: bool,
) -> Response:
    """Every choice's whole reply, once all have ended. asked: the request asked for logprobs; reads_calls: its
    reply is read for tool calls."""
    streams, running = [c.stream for c in choices], len(choices)
    check_at = time.monotonic() + DISCONNECT_CHECK_S
    while running:
        try:
            i, events = await asyncio.wait_for(queue.get(), DISCONNECT_CHECK_S)
        except TimeoutError:
            i, events = -1, []
        if time.monotonic() >= check_at:  # by the clock: a reply's events come every few milliseconds
            if await request.is_disconnected():
                cancel_all(engine, streams)
                return Response(status_code=499)
            check_at = time.monotonic() + DISCONNECT_CHECK_S
        if not events:
            continue
        choice, last = choices[i], events[-1]
        choice.content += [e.content for e in events]
        choice.calls += [d for e in events for d in e.tool_calls]
        choice.logprobs += [lp for e in events for lp in e.logprobs]
        choice.token_ids += [t for e in events for t in e.token_ids]
        if last.finished:
            if (error := failure(last)) is not None:
                cancel_all(engine, streams)
                raise error
            choice.finish_reason, running = last.finish_reason, running - 1
    shown = []
    for i, c in enumerate(choices):
        content, calls = "".join(c.content), [call.openai() for call in whole_calls(c.calls)]
        logprobs = c.logprobs if asked else None
        text = content or None if reads_calls else content  # with tools, no text is null, as OpenAI
        shown.append(responder.choice(i, text, c.finish(c.finish_reason), calls, logprobs, c.token_ids))
    return JSONResponse(responder.whole(shown, usage(streams)))
