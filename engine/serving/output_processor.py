"""The engine core's token ids to each request's events, in the front end (front_end.py): the in-process engine
runs it on the core's thread after each step, the engine process's parent on the thread that reads the child's
messages. Per request it detokenizes and finds stop strings (detokenizer.py), starts the text of a reply whose
chat template opened a thinking block with the block's tag, reads the text into thinking, answer and tool calls
(engine/reply_reader.py), and measures the request's stats where its tokens arrive. A stop string ends a request
here; the core is told to abort it."""

from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from llamaterm.engine.api import ArrivalStats, Event, EventStream, TokenLogprob
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.reply_reader import ReplyReader
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.detokenizer import IncrementalDetokenizer
from llamaterm.engine.thinking import OPEN as THINK_OPEN


class TokenOutput(NamedTuple):
    """What the engine core says of a request, a token or its end at a time: the token (-1: none), and for the
    last, why it ended. A "stop" carries its stop token (no text), a "length" the reply's last token (text)."""

    request_id: int
    token: int
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    logprob: TokenLogprob | None = None  # where the request asked and the token is its reply's


@dataclass(eq=False)
class RequestState(ArrivalStats, EventStream):
    """The caller's side of a request: its events as its tokens arrive, the reply's token ids, and its stats."""

    id: int
    detokenizer: IncrementalDetokenizer
    reader: ReplyReader
    prompt_tokens: int
    max_context: int
    events_queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cached_tokens: int = 0
    generated: int = 0
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    token_times: deque = field(default_factory=lambda: deque(maxlen=32))
    token_ids: list[int] = field(default_factory=list)

    def push(self, output: TokenOutput, now: float) -> tuple[bool, bool]:
        """One output of the core. Returns (finished, a stop string ended it here: the core must abort it)."""
        _, token, reason, error, logprob = output
        if token >= 0:
            self.generated += 1
            self.token_ids.append(token)
            self.token_times.append(now)
            self.first_token = self.first_token or now
        text, stopped = "", False
        if token >= 0 and reason in (None, "length"):  # a "stop" output's token is a stop token: no text
            text, stopped = self.detokenizer.push(token)
        if stopped:
            reason = "stop"
        logprobs = () if logprob is None else (logprob,)
        if reason is None:
            self._put(Event(self.id, text, (token,), logprobs=logprobs))
            return False, False
        if reason in ("length", "stop") and error is None:
            text += self.detokenizer.finish()
        self.end = now
        ids = (token,) if token >= 0 else ()
        self._put(Event(self.id, text, ids, True, reason, error, logprobs))
        return True, stopped

    def fail(self, error: str) -> None:
        self.end = time.perf_counter()
        self._put(Event(self.id, finished=True, finish_reason="error", error=error))

    def _put(self, event: Event) -> None:
        """The event with the reader's pieces of its text; the last gives what the reader held back."""
        piece = self.reader.push(event.text, final=event.finished)
        self.events_queue.put(replace(event, **piece._asdict()))


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_context: int):
        self.tokenizer, self.max_context = tokenizer, max_context
        self.requests: dict[int, RequestState] = {}  # those not ended yet

    def add(
        self, request_id: int, params: SamplingParams, prompt_tokens: int, opens_thinking: bool, reader: ReplyReader
    ) -> RequestState:
        """A request about to reach the core. opens_thinking: its chat template opened a thinking block, which the
        reply's text starts with (engine/thinking.py); reader: how its text is read (engine/reply_reader.py)."""
        text = IncrementalDetokenizer(self.tokenizer, params.stop, THINK_OPEN if opens_thinking else "")
        state = RequestState(request_id, text, reader, prompt_tokens, self.max_context)
        self.requests[request_id] = state
        return state

    def process(self, outputs: list[TokenOutput], cached: list[tuple[int, int]]) -> list[int]:
        """A step's outputs (or several steps', as they came), and the prompt tokens served from the prefix cache of
        the requests whose first token is among them. Returns the requests that ended here, which the core must
        abort: by a stop string, or a failure (one request's failure stays its own)."""
        now = time.perf_counter()
        for request_id, tokens in cached:
            if (state := self.requests.get(request_id)) is not None:
                state.cached_tokens = tokens
        ended = []
        for output in outputs:
            if (state := self.requests.get(output.request_id)) is None:  # ended here, by a stop string
                continue
            try:
                finished, stopped = state.push(output, now)
            except Exception as e:
                state.fail(f"{type(e).__name__}: {e}")
                finished = stopped = True
            if finished:
                del self.requests[output.request_id]
            if stopped:
                ended.append(output.request_id)
        return ended

    def end_all(self, error: str) -> None:
        """The core is gone: every request not ended yet ends with `error` rather than leaving its reader waiting."""
        for request_id, state in list(self.requests.items()):
            state.fail(error)
            del self.requests[request_id]
