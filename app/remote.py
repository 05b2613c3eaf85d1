"""An OpenAI-compatible server as an engine (`llamaterm serve`, vLLM, SGLang, llama.cpp's server): RemoteEngine meets
engine.api.EngineClient; each request streams in a thread of its own, its stats measured from the stream, and every
read from a server bounded in time, size and depth (README's How it works).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple, Unpack
from urllib.parse import urlsplit

import httpx2

from llamaterm.engine.api import (
    ArrivalStats,
    EngineStats,
    Event,
    EventStream,
    RequestStream,
    SubmitOptions,
    TokenLogprob,
    ToolCallDelta,
)
from llamaterm.engine.checkpoints.sampling_defaults import SERVER_DEFAULTS
from llamaterm.engine.errors import LlamatermError, ModelNotFound, RequestError
from llamaterm.engine.reply_reader import ReplyReader
from llamaterm.engine.sampling_params import Grammar, SamplingParams

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # a long prompt queued behind a full batch on a busy server still answers within this
MAX_LINE_BYTES = 1 << 20  # one server-sent event's line: a chunk of a few tokens, with logprobs, is a few kB
MAX_MODELS_BYTES = 1 << 20  # the /models reply
RATE_WINDOW_S = 2.0  # as the engine's aggregate rate
RATE_TOKENS = 32  # as the engine's per-request rate: over the last 32 tokens


class ServerTokens:
    """The tokens a server named in its replies' logprobs, numbered here as they first come: OpenAI's logprobs name
    a token by its text and bytes, not its id, and Event.logprobs carries ids. Token ids of a remote engine are
    these numbers, which mean nothing to the server; token_bytes gives back what each stands for."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._pieces: list[bytes] = []
        self._lock = threading.Lock()  # requests' reader threads number tokens at once

    def id_of(self, piece: bytes) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]


class Delta(NamedTuple):
    """What a chunk of a server's reply adds to one choice."""

    text: str
    reasoning: str
    tool_calls: tuple[ToolCallDelta, ...]
    logprobs: tuple[TokenLogprob, ...]
    token_ids: tuple[int, ...]


class RemoteStream(ArrivalStats, EventStream):
    def __init__(self, request_id: int, max_context: int, tokens: ServerTokens):
        self.id = request_id
        self.tokens = tokens
        self.events_queue = queue.SimpleQueue()
        self.max_context = max_context
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.token_times: deque[float] = deque(maxlen=RATE_TOKENS)
        self.generated = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.end: float | None = None
        self.response: httpx2.Response | None = None  # while the reply streams
        self.lock = threading.Lock()  # the reader thread and a cancel both may end the stream, once
        self.reader = ReplyReader()  # its text read as the engine reads a reply's, under the lock

    def text(self, delta: Delta, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)
        self.generated += 1
        event = Event(self.id, delta.text, delta.token_ids, logprobs=delta.logprobs)
        with self.lock:
            self._put(event, delta.reasoning, delta.tool_calls)

    def finish(self, reason: str, error: str | None = None) -> bool:
        """The last event; False when the stream had already ended (cancelled while the reader still read)."""
        with self.lock:
            if self.end is not None:
                return False
            self.end = time.perf_counter()
            self._put(Event(self.id, finished=True, finish_reason=reason, error=error))
            return True

    def _put(self, event: Event, reasoning: str = "", calls: tuple[ToolCallDelta, ...] = ()) -> None:
        """The event with its text read as the engine reads a reply's (a llamaterm server's content holds the
        thinking as a <think> block), and what the server read itself: its reasoning, its calls."""
        piece = self.reader.push(event.text, final=event.finished)
        thinking = reasoning + piece.thinking
        event = replace(event, content=piece.content, thinking=thinking, answer=piece.answer, tool_calls=calls)
        self.events_queue.put(event)


class RemoteEngine:
    """Satisfies engine.api.EngineClient with a model on an OpenAI-compatible server."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, token_ids: bool = False):
        """Checks the server at once (GET /models): one that is down, refuses the key, is not OpenAI-compatible or
        lacks `model` raises LlamatermError. model None: the server's first model. token_ids: ask for the reply's
        token ids too (vLLM's return_token_ids, which llamaterm serve takes; a strict server refuses it), into
        the events' token_ids."""
        self.base_url = api_base(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx2.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx2.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
            verify=self.base_url.startswith("https:"),  # plain http needs no TLS context (its CA bundle loads slowly)
        )
        cards = self._models()
        card = cards[0] if model is None else next((c for c in cards if c.get("id") == model), None)
        if card is None:
            names = ", ".join(str(c.get("id")) for c in cards)
            raise ModelNotFound(f"the server at {self.base_url} has no model {model!r}: it serves {names}")
        self.model_name = str(card["id"])
        self.max_context = count(card.get("max_model_len")) or 0  # vLLM, SGLang and llamaterm say; 0: not known
        self.device = urlsplit(self.base_url).netloc
        self.sampling_defaults = SERVER_DEFAULTS  # the server fills what the user left unset with its own
        self.tokens = ServerTokens()  # the ids of Event.logprobs
        self.token_ids = token_ids
        self._ids = itertools.count(1)
        self._live: dict[int, RemoteStream] = {}
        self._closed = False

    def submit(
        self, prompt: list[dict] | str | None, params: SamplingParams | None = None, **options: Unpack[SubmitOptions]
    ) -> RemoteStream:
        """Returns at once; the server's answer, a refusal included, arrives as the stream's events. A server takes
        text: token ids are refused here. tools go as OpenAI's, for its template to render, the reply read as text
        (tool_choice "none")."""
        if self._closed:
            raise LlamatermError("the connection to the server is closed")
        if options.get("prompt_ids") is not None:
            raise RequestError("a server takes prompts as text or chat messages, not token ids")
        params = params or SamplingParams()
        path, body = request_body(self.model_name, prompt or "", params, **options)
        body |= {"return_token_ids": True} if self.token_ids else {}
        try:
            content = json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a lone surrogate: an undecodable byte from argv or stdin
            raise RequestError(
                "the text is not valid Unicode (a lone surrogate, or a byte that is not UTF-8): give UTF-8 text"
            ) from None
        stream = RemoteStream(next(self._ids), self.max_context, self.tokens)
        self._live[stream.id] = stream
        threading.Thread(target=self._read, args=(stream, path, content), name="llamaterm-remote", daemon=True).start()
        return stream

    def cancel(self, handle: RequestStream | int) -> None:
        """Ends the stream now and closes its connection, which cancels the request on the server."""
        stream = self._live.get(handle if isinstance(handle, int) else handle.id)
        if stream is not None and stream.finish("cancelled") and stream.response is not None:
            stream.response.close()  # the reader's wait for the next chunk ends in an error it ignores

    def stats(self) -> EngineStats:
        """This client's view: its requests in flight and their tokens/s (a server does not say its KV use)."""
        live = list(self._live.values())
        now = time.perf_counter()
        recent = sorted(t for s in live for t in s.token_times if now - t <= RATE_WINDOW_S)
        span = now - recent[0] if recent else 0.0
        return EngineStats(
            model=self.model_name,
            device=self.device,
            running=len(live),
            batch_size=len(live),
            tokens_per_s=len(recent) / span if span > 0.05 else 0.0,
        )

    def shutdown(self) -> None:
        self._closed = True
        for stream in list(self._live.values()):
            stream.finish("cancelled")
        self.http.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _models(self) -> list[dict]:
        where = f"the server at {self.base_url}"
        try:  # one that never answers is not a server
            with self.http.stream("GET", "/models", timeout=CONNECT_TIMEOUT_S) as reply:
                body = read_at_most(reply, MAX_MODELS_BYTES)
        except httpx2.HTTPError as e:
            raise LlamatermError(
                f"cannot reach {where} ({type(e).__name__}: {e}): is it running, and is the URL right?"
            ) from None
        except ServerError as e:
            raise LlamatermError(f"{where} is not an OpenAI-compatible server ({e}): check the URL") from None
        if reply.status_code == 401:
            raise LlamatermError(f"{where} refused the API key: give the right one with --api-key")
        try:
            cards = json.loads(body or b"null")["data"]
            assert reply.status_code == 200 and isinstance(cards, list) and cards
            assert all(isinstance(c, dict) and "id" in c for c in cards)
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError):
            raise LlamatermError(
                f"{where} is not an OpenAI-compatible server (GET /models answered "
                f"{reply.status_code} without a list of models): check the URL"
            ) from None
        return cards

    def _read(self, stream: RemoteStream, path: str, body: bytes) -> None:
        """The request's thread: the server's chunks in, events out, until the end, an error or a cancel (after
        which the stream has ended and finish() does nothing)."""
        try:
            with self.http.stream("POST", path, content=body, headers={"Content-Type": "application/json"}) as reply:
                stream.response = reply
                if stream.end is not None:  # cancelled while connecting
                    return
                if reply.status_code != 200:
                    text = read_at_most(reply, MAX_LINE_BYTES).decode(errors="replace")
                    stream.finish(
                        "error", f"the server refused the request ({reply.status_code}): {error_message(text)}"
                    )
                    return
                reason = read_events(stream, reply)
            if reason is None:
                stream.finish("error", "the server closed the stream before the reply ended")
            else:
                stream.finish(reason)
        except (httpx2.HTTPError, httpx2.StreamError) as e:
            stream.finish("error", f"the connection to the server failed ({type(e).__name__}: {e})")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # not JSON, not OpenAI's shape
            problem = "JSON nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
            stream.finish("error", f"the server's reply is not OpenAI-compatible ({problem})")
        except ServerError as e:
            stream.finish("error", str(e))
        finally:
            self._live.pop(stream.id, None)


def read_events(stream: RemoteStream, reply: httpx2.Response) -> str | None:
    """The reply's server-sent events into the stream, until [DONE], the reply's end or a cancel; returns the
    finish reason the server gave (None: none yet)."""
    reason = None
    progress = time.monotonic()  # when the reply last moved on
    for line in lines(reply):
        if stream.end is not None:  # cancelled: leaving closes the connection
            break
        data = line.removeprefix("data:").strip() if line.startswith("data:") else None
        if data == "[DONE]":
            break
        if data:
            before = stream.generated
            reason = take_chunk(stream, json.loads(data)) or reason
            if stream.generated != before or reason is not None:
                progress = time.monotonic()
        if time.monotonic() - progress > READ_TIMEOUT_S:
            raise ServerError(f"the server sent no text of the reply for {READ_TIMEOUT_S:.0f} s")
    return reason


def read_at_most(reply: httpx2.Response, limit: int) -> bytes:
    """A reply's body; ServerError past `limit` bytes."""
    body = b""
    for chunk in reply.iter_bytes():
        body += chunk
        if len(body) > limit:
            raise ServerError(f"the server's reply is over {limit} bytes, more than any OpenAI-compatible reply")
    return body


def lines(reply: httpx2.Response) -> Iterator[str]:
    """The lines of a server-sent event stream, each at most MAX_LINE_BYTES (ServerError past that)."""
    pending = b""
    for chunk in reply.iter_bytes():
        pending += chunk
        *whole, pending = pending.split(b"\n")
        for line in whole:
            yield line.removesuffix(b"\r").decode()  # not UTF-8: a ValueError, a reply not in OpenAI's shape
        if len(pending) > MAX_LINE_BYTES:
            raise ServerError(f"the server sent a line of over {MAX_LINE_BYTES} bytes, more than any reply's chunk")
    if pending:
        yield pending.removesuffix(b"\r").decode()


def take_chunk(stream: RemoteStream, chunk: dict) -> str | None:
    """One chunk into the stream: its text and usage. Returns its finish reason, if it has one."""
    if "error" in chunk:
        raise ServerError(f"the server failed the request: {error_message(json.dumps(chunk))}")
    usage = chunk.get("usage")
    if usage:
        stream.prompt_tokens = count(usage.get("prompt_tokens")) or 0
        stream.generated = count(usage.get("completion_tokens")) or stream.generated
        stream.cached_tokens = count((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    reason = None
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        # the thinking a server read itself: vLLM's and llama.cpp's reasoning_content, vLLM's newer reasoning
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if not isinstance(text, str | None) or not isinstance(reasoning, str | None):
            raise TypeError(f"a choice of {json.dumps(choice)[:100]}")
        if not isinstance(choice.get("finish_reason"), str | None):
            raise TypeError(f"a choice of {json.dumps(choice)[:100]}")
        logprobs = token_logprobs(choice.get("logprobs"), stream.tokens)
        ids = choice.get("token_ids") or []  # where asked for (RemoteEngine.token_ids)
        if not all(count(t) is not None for t in ids):
            raise TypeError(f"token_ids of {json.dumps(ids)[:100]}")
        calls = tool_call_deltas(delta.get("tool_calls") or [])
        if text or reasoning or calls or logprobs or ids:
            stream.text(Delta(text or "", reasoning or "", calls, logprobs, tuple(ids)), time.perf_counter())
        reason = choice.get("finish_reason") or reason
    return reason


def tool_call_deltas(shown: list) -> tuple[ToolCallDelta, ...]:
    """A chunk's delta.tool_calls as events carry them. TypeError or KeyError where they are not in OpenAI's
    shape."""
    out = []
    for d in shown:
        function = d.get("function") or {}
        index, call_id, name, arguments = d["index"], d.get("id"), function.get("name"), function.get("arguments") or ""
        if count(index) is None or not all(isinstance(x, str | None) for x in (call_id, name, arguments)):
            raise TypeError(f"a tool call of {json.dumps(d)[:100]}")
        out.append(ToolCallDelta(index, arguments, call_id, name))
    return tuple(out)


def token_logprobs(shown: dict | None, tokens: ServerTokens) -> tuple[TokenLogprob, ...]:
    """A choice's logprobs as events carry them: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or
    a text completion's parallel lists (tokens, token_logprobs, top_logprobs as {token: logprob}). TypeError or
    KeyError where they are in neither shape."""
    if shown is None:
        return ()
    if "content" in shown:
        return tuple(
            TokenLogprob(
                tokens.id_of(piece(entry)),
                number(entry["logprob"]),
                tuple((tokens.id_of(piece(alt)), number(alt["logprob"])) for alt in entry.get("top_logprobs") or []),
            )
            for entry in shown["content"] or []
        )
    names, values, tops = shown["tokens"], shown["token_logprobs"], shown.get("top_logprobs") or []
    if len(names) != len(values) or (tops and len(tops) != len(names)):
        raise TypeError("logprobs' lists of different lengths")
    tops = tops or [{}] * len(names)
    return tuple(
        TokenLogprob(
            tokens.id_of(name.encode()),
            number(value),
            tuple((tokens.id_of(t.encode()), number(lp)) for t, lp in sorted(top.items(), key=lambda x: -x[1])),
        )
        for name, value, top in zip(names, values, tops, strict=True)
    )


def piece(entry: dict) -> bytes:
    """The bytes a chat logprob entry's token stands for: its `bytes`, else its text's."""
    raw = entry.get("bytes")
    if raw is None:
        return entry["token"].encode()
    return bytes(raw)  # TypeError or ValueError for anything but a list of bytes


def number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a logprob of {json.dumps(value)[:40]}")
    return float(value)


def count(value: object) -> int | None:
    """A token count from the server, or None where it sent something else."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def api_base(url: str) -> str:
    """The API's base URL: a bare http://host:port means its /v1, as every OpenAI-compatible server has it."""
    problem = LlamatermError(f"{url!r} is not a server URL: give one like http://127.0.0.1:8000/v1")
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.netloc or any(c.isspace() for c in url):
            raise problem
        base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/') or '/v1'}"
        if parts.port == 0:  # reading the port refuses one out of range, too
            raise problem
        httpx2.URL(base)  # httpx refuses a host it cannot use, such as 256.1.1.1
    except (ValueError, httpx2.InvalidURL):
        raise problem from None
    return base


def request_body(
    model: str, prompt: list[dict] | str, params: SamplingParams, **options: Unpack[SubmitOptions]
) -> tuple[str, dict]:
    """The path and JSON body of a streamed request. Sampling values the user left unset (params.unset) are left
    out, for the server's defaults, so strict servers see none beyond OpenAI's own (top_k, min_p,
    repetition_penalty: vLLM's and SGLang's names) unless given; a value given goes, off or not (a top_k of 0: the
    server's default would filter). ignore_eos goes only where set; so do the template's thinking switch
    (chat_template_kwargs, as vLLM, SGLang and llama.cpp's server read it) and a raw prompt's literal reading
    (parse_special, as llama.cpp's server names it). Logprobs go as OpenAI asks for them: chat's logprobs and
    top_logprobs, a text completion's logprobs (the count). A chat's tools go with tool_choice "none": rendered in
    the prompt, the reply read as text."""
    body: dict = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params.max_tokens,
    }
    optional = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "presence_penalty": params.presence_penalty or None,
        "frequency_penalty": params.frequency_penalty or None,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "ignore_eos": params.ignore_eos or None,
    }
    body |= {k: v for k, v in optional.items() if v is not None and k not in params.unset}
    body |= grammar_fields(params.grammar)
    if options.get("raw"):
        body |= {} if params.logprobs is None else {"logprobs": params.logprobs}  # OpenAI's older form: a count
        literal = {} if options.get("parse_special", True) else {"parse_special": False}
        return "/completions", body | {"prompt": prompt} | literal
    if params.logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": params.logprobs}
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if (thinking := options.get("enable_thinking")) is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if tools := options.get("tools"):
        body |= {"tools": tools, "tool_choice": "none"}
    return "/chat/completions", body | {"messages": messages}


def grammar_fields(grammar: Grammar | None) -> dict:
    """A reply's grammar as servers take it: JSON as OpenAI's response_format, a regex or grammar as vLLM's
    structured_outputs (which llamaterm serve reads too)."""
    if grammar is None:
        return {}
    if grammar.kind == "json":
        return {"response_format": {"type": "json_object"}}
    if grammar.kind == "json_schema":
        spec = {"name": "reply", "schema": json.loads(grammar.text), "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"structured_outputs": {"regex" if grammar.kind == "regex" else "grammar": grammar.text}}


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body, or the body's start."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200] or "no reason given"


class ServerError(Exception):
    """An error object in the stream."""
