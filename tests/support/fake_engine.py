"""A stand-in for llamaterm.engine.serving.engine.Engine with the same API: it streams canned text from its own thread.

Each running request gets one word-sized token of its reply per step, at `tokens_per_s` steps a second. The
stats are the nominal ones (rate = tokens_per_s, TTFT = one step), so screens that show them are deterministic.
Asked for logprobs, a reply's tokens have the probabilities PROBABILITIES in turn, the rest of each token's
probability going to ALTERNATIVES, halving from one to the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Unpack

from llamaterm.engine.api import (
    EngineStats,
    Event,
    EventStream,
    RequestStats,
    RequestStream,
    SubmitOptions,
    TokenLogprob,
)
from llamaterm.engine.checkpoints.chat_template import CHATML_TEMPLATE, ChatTemplate
from llamaterm.engine.checkpoints.sampling_defaults import LLAMA_CPP_DEFAULTS, SamplingDefaults
from llamaterm.engine.errors import RequestError
from llamaterm.engine.reply_reader import ReplyReader, reader_for
from llamaterm.engine.sampling_params import SamplingParams

BLOCK_SIZE = 16
REPLY = """Here is a small example in **Python**:

```python
def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)
```

It runs in *exponential* time; memoize it for speed.
"""
PROBABILITIES = (0.9, 0.6, 0.3)  # of a reply's tokens in turn
ALTERNATIVES = (" maybe", " perhaps", " instead", " or", " not")


def words(text: str) -> list[str]:
    return re.findall(r"\s*\S+|\s+", text)


class FakeTokenizer:
    """The fake's vocabulary: each word it has seen, numbered as it first came."""

    chat_template = ChatTemplate(CHATML_TEMPLATE)  # a server reads a reply by its model's template: plain text here

    def __init__(self) -> None:
        self.words: dict[str, int] = {}
        self.lock = threading.Lock()

    def id_of(self, word: str) -> int:
        with self.lock:
            return self.words.setdefault(word, len(self.words))

    def token_bytes(self, token_id: int) -> bytes:
        return next(w for w, i in self.words.items() if i == token_id).encode()


def fake_logprob(tokenizer: FakeTokenizer, word: str, position: int, wanted: int) -> TokenLogprob:
    """The reply's word at `position` and its `wanted` likeliest alternatives."""
    p = PROBABILITIES[position % len(PROBABILITIES)]
    choices = [(word, p)] + [(alt, (1 - p) / 2 ** (k + 1)) for k, alt in enumerate(ALTERNATIVES)]
    top = sorted(choices, key=lambda c: -c[1])[:wanted]
    return TokenLogprob(tokenizer.id_of(word), math.log(p), tuple((tokenizer.id_of(w), math.log(q)) for w, q in top))


@dataclass(eq=False)
class FakeHandle(EventStream):
    id: int
    prompt: list[str]
    reply: list[str]
    params: SamplingParams
    cached_tokens: int
    engine: FakeEngine
    reader: ReplyReader  # its text read as the engine's output processor reads it
    events_queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    generated: int = 0
    finished: bool = False

    def put(self, event: Event) -> None:
        piece = self.reader.push(event.text, final=event.finished)
        self.events_queue.put(dataclasses.replace(event, **piece._asdict()))

    def stats(self) -> RequestStats:
        rate = self.engine.tokens_per_s
        return RequestStats(
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            generated_tokens=self.generated,
            ttft_s=1 / rate if self.generated else None,
            tokens_per_s=rate if self.generated else 0.0,
            elapsed_s=self.generated / rate,
            context_tokens=len(self.prompt) + self.generated,
            max_context=self.engine.max_context,
            finished=self.finished,
        )


class FakeEngine:
    def __init__(
        self,
        reply: str | Callable[[list[dict]], str] = REPLY,
        *,
        tokens_per_s: float = 200.0,
        hold: bool = False,
        model_name: str = "fake-llama",
        device: str = "cpu",
        max_context: int = 2048,
        sampling_defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS,
    ):
        """reply: the text of every reply, or a function of the request's messages that gives it.
        hold: after the reply, keep the request running (as if still generating) until it is cancelled.
        sampling_defaults: the model's, as a real engine reads them from its files."""
        self.reply = reply if callable(reply) else lambda messages: reply
        self.tokens_per_s = tokens_per_s
        self.hold = hold
        self.model_name, self.device, self.max_context = model_name, device, max_context
        self.sampling_defaults = sampling_defaults
        self.vocabulary = FakeTokenizer()  # the ids of its events
        self.tokenizer = self.vocabulary  # what callers name tokens by (a subclass may put a real one here)
        self.submitted: list[tuple[list[dict], SamplingParams]] = []
        self.thinking_switches: list[bool | None] = []  # each request's enable_thinking
        self._ids = itertools.count(1)
        self._live: list[FakeHandle] = []
        self._prompts: list[list[str]] = []  # for the prefix cache's hit count
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def together(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # its requests stream at once, one by one

    def submit(
        self,
        messages: list[dict] | str | None,
        params: SamplingParams | None = None,
        **options: Unpack[SubmitOptions],
    ) -> FakeHandle:
        params = params or SamplingParams()
        messages = messages or ""  # (its replies are canned: token ids read as no words)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        prompt = [tok for m in messages for tok in [f"<{m['role']}>", *words(m["content"])]]
        if len(prompt) >= self.max_context:
            raise RequestError(f"the prompt is {len(prompt)} tokens but the model's context holds {self.max_context}")
        with self._cv:
            if self._stopped:
                raise RequestError("the engine has shut down")
            cached = max((common_prefix(prompt, p) for p in self._prompts), default=0) // BLOCK_SIZE * BLOCK_SIZE
            self._prompts.append(prompt)
            reply, reader = words(self.reply(messages)), reader_for(self.tokenizer, options)
            handle = FakeHandle(next(self._ids), prompt, reply, params, cached, self, reader)
            self.submitted.append((messages, params))
            self.thinking_switches.append(options.get("enable_thinking"))
            self._live.append(handle)
            self._cv.notify()
        return handle

    def cancel(self, handle: RequestStream | int) -> None:
        request_id = handle if isinstance(handle, int) else handle.id
        with self._cv:
            for live in [h for h in self._live if h.id == request_id]:
                self._finish(live, "cancelled")

    def stats(self) -> EngineStats:
        with self._cv:
            live = list(self._live)
        return EngineStats(
            model=self.model_name,
            device=self.device,
            running=len(live),
            waiting=0,
            batch_size=len(live),
            kv_blocks_used=sum(-(-(len(h.prompt) + h.generated) // BLOCK_SIZE) for h in live),
            kv_blocks_total=1024,
            tokens_per_s=self.tokens_per_s * len(live),
        )

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            for handle in list(self._live):
                self._finish(handle, "cancelled")
            self._cv.notify()
        self._thread.join()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> None:
        with self._cv:
            while not self._stopped:
                if not self._live:
                    self._cv.wait()
                    continue
                for handle in list(self._live):
                    self._step(handle)
                self._cv.wait(1 / self.tokens_per_s)

    def _step(self, handle: FakeHandle) -> None:
        limit = min(handle.params.max_tokens, len(handle.reply))
        if handle.generated >= limit:
            if not self.hold:
                self._finish(handle, "length" if limit == handle.params.max_tokens else "stop")
            return
        token, wanted = handle.reply[handle.generated], handle.params.logprobs
        logprobs = () if wanted is None else (fake_logprob(self.vocabulary, token, handle.generated, wanted),)
        handle.generated += 1
        handle.put(Event(handle.id, token, (self.vocabulary.id_of(token),), logprobs=logprobs))

    def _finish(self, handle: FakeHandle, reason: str) -> None:
        self._live.remove(handle)
        handle.finished = True
        handle.put(Event(handle.id, finished=True, finish_reason=reason))


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
