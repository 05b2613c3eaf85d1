"""`llamaterm serve`: one engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

/v1/models, /v1/chat/completions and /v1/completions, streamed (server-sent events) or not; /health; /metrics
(the engine's stats in Prometheus' text format). Every client's requests go to the one engine, which batches them.

The engine's events arrive on thread-safe queues. One pump task moves them onto asyncio queues every PUMP_S, so a
waiting stream holds no thread and the event loop never blocks; submits (tokenizing, a pipe round trip) run in
the thread pool. A client that disconnects cancels its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from llamaterm.engine.api import EngineClient, EngineStats, Event, RequestStream
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import SamplingParams

PUMP_S = 0.01  # how often the live requests' events are collected (the engine process sends one message per step)
DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request looks for a client that left
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Request fields beyond the sampling ones. OpenAI's own that change nothing here are ignored; those asking for
# what the engine lacks are accepted only at their default; any other name is refused, as the OpenAI API does.
IGNORED = {
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "chat_template_kwargs",
}
ONLY_DEFAULT = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
INTS = ["top_k", "seed"]


class APIError(Exception):
    """An OpenAI-style error object and its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


@dataclass(frozen=True)
class Completion:
    """A parsed request: what to submit and how to answer."""

    prompt: list[dict] | str
    raw: bool  # a /v1/completions prompt: no chat template
    params: SamplingParams
    stream: bool
    include_usage: bool
    enable_thinking: bool | None = None  # the chat template's thinking switch (None: the template's default)


# ---- request parsing: pure functions of the JSON body ----


def parse_request(body: object, model_name: str, max_context: int, chat: bool) -> Completion:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "you must give a model: see /v1/models", "model")
    if model != model_name:
        raise APIError(
            404, f"the model '{model}' does not exist: this server has '{model_name}'", "model", "model_not_found"
        )
    prompt = parse_messages(body.get("messages")) if chat else parse_prompt(body.get("prompt"))
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise APIError(400, "stream must be true or false and stream_options an object", "stream")
    return Completion(
        prompt,
        not chat,
        parse_params(body, max_context),
        stream,
        bool(options.get("include_usage")),
        parse_thinking(body.get("chat_template_kwargs"), chat),
    )


def parse_thinking(kwargs: object, chat: bool) -> bool | None:
    """vLLM's and SGLang's chat_template_kwargs, of which the engine takes the thinking switch."""
    if kwargs is None:
        return None
    if (
        not chat
        or not isinstance(kwargs, dict)
        or set(kwargs) - {"enable_thinking"}
        or not isinstance(kwargs.get("enable_thinking", False), bool)
    ):
        raise APIError(
            400,
            'chat_template_kwargs takes {"enable_thinking": true or false} on chat completions only',
            "chat_template_kwargs",
        )
    return kwargs.get("enable_thinking")


def parse_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}", f"messages[{i}].role"
            )
        out.append({"role": ROLES[role], "content": message_text(m.get("content"), i)})
    return out


def message_text(content: object, i: int) -> str:
    """A string, or an array of text parts (images and audio are refused: the engine reads text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or an array of text parts", f"messages[{i}].content")


def parse_prompt(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string (one prompt per request)", "prompt")
    return prompt


def parse_params(body: dict, max_context: int) -> SamplingParams:
    known = (
        IGNORED
        | ONLY_DEFAULT.keys()
        | set(FLOATS)
        | set(INTS)
        | {"max_tokens", "max_completion_tokens", "stop", "ignore_eos"}
    )
    for name in body:
        if name not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", name)
    for name, defaults in ONLY_DEFAULT.items():
        if name in body and body[name] not in defaults:
            raise APIError(400, f"{name} = {body[name]!r} is not supported by this server", name)
    values: dict = {}
    for name in FLOATS + INTS:
        value = body.get(name)
        if value is None:
            continue
        kinds = (int, float) if name in FLOATS else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise APIError(400, f"{name} must be a {'number' if name in FLOATS else 'whole number'}", name)
        values[name] = value
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_context:
            raise APIError(
                400,
                f"max_tokens must be a whole number from 1 to {max_context} (the model's context), not {max_tokens!r}",
                "max_tokens",
            )
        values["max_tokens"] = max_tokens
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or an array of strings", "stop")
    if not isinstance(body.get("ignore_eos", False), bool):
        raise APIError(400, "ignore_eos must be true or false", "ignore_eos")
    try:
        return SamplingParams(stop=tuple(stop), ignore_eos=body.get("ignore_eos", False), **values)
    except RequestError as e:
        raise APIError(400, str(e)) from None


# ---- engine events to asyncio ----


class EventPump:
    """Moves every live request's events from its thread-safe queue to an asyncio queue, a batch per poll."""

    def __init__(self):
        self.live: dict[RequestStream, asyncio.Queue[list[Event]]] = {}
        self.wake = asyncio.Event()

    def watch(self, stream: RequestStream) -> asyncio.Queue[list[Event]]:
        queue = self.live[stream] = asyncio.Queue()
        self.wake.set()
        return queue

    async def run(self) -> None:
        while True:
            if not self.live:
                await self.wake.wait()
                self.wake.clear()
            for stream, queue in list(self.live.items()):
                events = stream.poll()
                if events:
                    queue.put_nowait(events)
                    if events[-1].finished:
                        del self.live[stream]
            await asyncio.sleep(PUMP_S)


# ---- responses ----


def usage(stream: RequestStream) -> dict:
    st = stream.stats()
    return {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.generated_tokens,
        "total_tokens": st.prompt_tokens + st.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
    }


def failure(event: Event) -> APIError | None:
    """A request that ended without a reply of its own: the engine failed it or is shutting down."""
    if event.error:
        return APIError(500, f"generation failed: {event.error}", kind="server_error")
    if event.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled: the server is shutting down", kind="server_error")
    return None


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Responder:
    """The JSON shapes of one response, chat or text completion."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            if self.chat
            else {"index": 0, "text": text, "logprobs": None}
        )
        return self.envelope(
            "chat.completion" if self.chat else "text_completion",
            [{**choice, "finish_reason": finish_reason}],
            usage=usage,
        )

    def chunk(self, text: str, finish_reason: str | None = None, role: bool = False, **extra) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self.envelope(self.chunk_kind, [choice], **extra)

    def envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class EngineStreamResponse(StreamingResponse):
    """Server-sent events of one request; however the response ends (a client that left, a server stopping),
    a request still running is cancelled."""

    def __init__(self, content: AsyncIterator[str], engine: EngineClient, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.engine, self.stream = engine, stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.stream.stats().finished:
                self.engine.cancel(self.stream)


def create_app(engine: EngineClient, api_key: str | None = None) -> Starlette:
    """The ASGI app over `engine` (which the caller owns and shuts down)."""
    pump = EventPump()

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(pump.run())
        yield
        task.cancel()

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(
                401, "Incorrect API key provided: give the server's key as a bearer token", code="invalid_api_key"
            )

    async def models(request: Request) -> Response:
        check_key(request)
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "llamaterm",
            "max_model_len": engine.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def complete(request: Request, chat: bool) -> Response:
        check_key(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "We could not parse the JSON body of your request: send valid JSON") from None
        req = parse_request(body, engine.model_name, engine.max_context, chat)
        try:
            stream = await run_in_threadpool(
                engine.submit, req.prompt, req.params, raw=req.raw, enable_thinking=req.enable_thinking
            )
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) or "pool" in str(e) else None
            raise APIError(400, str(e), "messages" if chat else "prompt", code) from None
        except LlamatermError as e:
            raise APIError(503, str(e), kind="server_error") from None
        queue = pump.watch(stream)
        responder = Responder(engine.model_name, chat)
        if req.stream:
            return EngineStreamResponse(stream_events(queue, stream, responder, req.include_usage), engine, stream)
        return await whole_reply(request, queue, stream, responder)

    async def stream_events(queue, stream, responder: Responder, include_usage: bool) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        yield sse(responder.chunk("", role=True, **extra))
        while True:
            events = await queue.get()
            last = events[-1]
            # the tokens that arrived since the last poll go as one chunk: at tens of thousands of tokens a second,
            # a chunk per token would cost the server more than the engine
            text = "".join(e.text for e in events[:-1])
            if last.finished:
                error = failure(last)
                if error is not None:
                    yield (sse(responder.chunk(text, **extra)) if text else "") + sse(error.body)
                    return
                out = [sse(responder.chunk(text + last.text, last.finish_reason, **extra))]
                if include_usage:
                    out.append(sse(responder.envelope(responder.chunk_kind, [], usage=usage(stream))))
                yield "".join(out) + "data: [DONE]\n\n"
                return
            if text + last.text:
                yield sse(responder.chunk(text + last.text, **extra))

    async def whole_reply(request: Request, queue, stream, responder: Responder) -> Response:
        text = []
        while True:
            try:
                events = await asyncio.wait_for(queue.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(stream)
                    return Response(status_code=499)
                continue
            text += [e.text for e in events]
            if events[-1].finished:
                error = failure(events[-1])
                if error is not None:
                    raise error
                return JSONResponse(responder.whole("".join(text), events[-1].finish_reason, usage(stream)))

    async def answer(request: Request, chat: bool) -> Response:
        try:
            return await complete(request, chat)
        except APIError:
            raise
        except Exception as e:  # not foreseen: still an error object, on a connection that stays open
            logging.getLogger("uvicorn.error").exception("a request failed")
            raise APIError(
                500, f"the server failed on this request ({type(e).__name__}: {e})", kind="server_error"
            ) from e

    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": engine.model_name})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(engine.stats()), media_type="text/plain; version=0.0.4")

    async def api_error(request: Request, exc: Exception) -> Response:
        return exc.response()  # type: ignore[attr-defined]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code  # type: ignore[attr-defined]
        message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed here"}
        return APIError(status, message.get(status, str(exc))).response()

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={APIError: api_error, HTTPException: http_error}
    )


METRICS = [  # (name, help, EngineStats field)
    ("llamaterm_requests_running", "Requests decoding or prefilling now.", "running"),
    ("llamaterm_requests_waiting", "Requests queued for a place in the batch.", "waiting"),
    ("llamaterm_batch_size", "Sequences in the engine's last step.", "batch_size"),
    ("llamaterm_kv_blocks_used", "KV cache blocks held by requests.", "kv_blocks_used"),
    ("llamaterm_kv_blocks_total", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("llamaterm_tokens_per_second", "Tokens generated per second, all requests together.", "tokens_per_s"),
]


def metrics_text(stats: EngineStats) -> str:
    """The engine's stats in Prometheus' text exposition format, a gauge each, labelled with the model."""
    lines = []
    for name, help, field in METRICS:
        lines += [
            f"# HELP {name} {help}",
            f"# TYPE {name} gauge",
            f'{name}{{model="{stats.model}"}} {getattr(stats, field)}',
        ]
    return "\n".join(lines) + "\n"


def check_port(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (in use, no such address), or None: known before the model loads."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def serve(engine: EngineClient, host: str, port: int, api_key: str | None) -> None:
    """Serve until interrupted (Ctrl-C)."""
    import uvicorn

    uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="warning")
