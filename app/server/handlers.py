"""The routes: /v1/models, /v1/chat/completions and /v1/completions, streamed (server-sent events) or not; /health;
/metrics. Each checks who asks (an API key, or a loopback Host for a keyless server), reads the body within its time
and size, parses it and submits its choices to the engine, in the thread pool (tokenizing, a pipe round trip)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from llamaterm.app.announcements import Announcer, proof
from llamaterm.app.openai_shapes import Responder
from llamaterm.app.presets import Preset
from llamaterm.app.server.errors import APIError, api_error, http_error, shutting_down
from llamaterm.app.server.grammars import check_grammar
from llamaterm.app.server.keep_alive import LOAD_HEADER, KeepAlive
from llamaterm.app.server.metrics import metrics_text
from llamaterm.app.server.requests import Completion, NamedTool, body_limit, parse_json, parse_request
from llamaterm.app.server.streaming import (
    Choice,
    EngineStreamResponse,
    EventPump,
    cancel_all,
    stream_events,
    whole_reply,
)
from llamaterm.app.server.supervisor import EngineSupervisor, SupervisedEngine
from llamaterm.engine.api import EngineClient, EngineStats, RequestStream
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.serving import grammar

BODY_TIMEOUT_S = 30  # a request's body must arrive within this of its headers (http_server.py times those)
LINGER_BYTES = 8 << 20  # of a body over its limit, how much more is read and dropped before the 413
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # --host values that take connections from this machine only
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}  # the names a request to them gives in its Host header
log = logging.getLogger("uvicorn.error")  # uvicorn prints it


class Service:
    """What the routes share with the server's stop: the engine's supervisor, the live requests' events, whether
    the server drains (refuses new requests while those in flight finish), the model's keep-alive (seconds; 0:
    forever), the preset whose system prompt and sampling values fill what requests leave out, and the web origins
    allowed (--allowed-origins)."""

    def __init__(
        self,
        supervisor: EngineSupervisor,
        keep_alive_s: float = 0,
        preset: Preset | None = None,
        allowed_origins: tuple[str, ...] = (),
    ):
        self.supervisor = supervisor
        self.pump = EventPump()
        self.draining = False
        self.keep_alive = KeepAlive(supervisor, self.pump, keep_alive_s)
        self.preset = preset
        self.allowed_origins = allowed_origins  # web pages' origins the server answers besides its own ("*": any)

    def gauges(self) -> dict[str, float]:
        """The server's own figures for /metrics (app/server/metrics.py SERVER_METRICS)."""
        supervisor, keep_alive = self.supervisor, self.keep_alive
        info = supervisor.engine.info if supervisor.loaded else {}
        return {
            "llamaterm_model_loaded": int(supervisor.loaded),
            "llamaterm_context_length": supervisor.engine.max_context,
            "llamaterm_memory_bytes": info.get("memory_bytes", 0),
            "llamaterm_kv_tokens": info.get("kv_tokens", 0),
            "llamaterm_keep_alive_seconds": keep_alive.seconds,
            "llamaterm_idle_seconds": 0 if not keep_alive.idle else time.monotonic() - keep_alive.last_used,
        }

    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.supervisor.alive:
            return "ok"
        return "failed" if self.supervisor.gave_up else "restarting"

    def stop(self) -> None:
        """Ends every request in flight with an error, and takes no more."""
        self.draining = True
        cancel_all(self.supervisor.engine, list(self.pump.live))
        self.pump.end_all()


def create_app(
    service: Service, api_key: str | None = None, host: str = "127.0.0.1", announcer: Announcer | None = None
) -> Starlette:
    """The ASGI app over the service's engine (which the caller owns and shuts down), for a server on `host`; one
    that announces itself (app/announcements.py) takes its local key too."""
    api = Handlers(service, api_key, host, announcer)

    @asynccontextmanager
    async def lifespan(app):
        tasks = [asyncio.create_task(service.pump.run()), asyncio.create_task(service.supervisor.watch())]
        if service.keep_alive.seconds:
            tasks.append(asyncio.create_task(service.keep_alive.watch()))
        yield
        for task in tasks:
            task.cancel()

    routes = [
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={APIError: api_error, HTTPException: http_error}
    )


class Handlers:
    """The routes' handlers over one service, for a server on `host` that asks for `api_key` (None: no key), or
    its announcer's local key."""

    def __init__(self, service: Service, api_key: str | None, host: str, announcer: Announcer | None = None):
        self.service, self.api_key, self.announcer = service, api_key, announcer
        # a web page's script can reach a keyless server on loopback under a name of the page's own (DNS rebinding):
        # such a server answers only requests that name loopback
        self.check_host = api_key is None and host in LOOPBACK

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        engine = self.service.supervisor.engine
        card = {
            "id": engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "llamaterm",
            "max_model_len": engine.max_context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        return await self.answer(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.answer(request, chat=False)

    async def health(self, request: Request) -> Response:
        """Without a key; asked with a challenge, it also proves that it holds its announcement's local key
        (app/announcements.py), so a client sends that key to nothing else."""
        self.authorize(request, key=False)
        status, supervisor = self.service.status(), self.service.supervisor
        shown = {"status": status, "model": supervisor.engine.model_name, "loaded": supervisor.loaded}
        challenge = request.query_params.get("challenge")
        if self.announcer is not None and challenge is not None:
            shown["proof"] = proof(self.announcer.key, challenge)
        return JSONResponse(shown, status_code=200 if status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        self.authorize(request)
        self.check_engine()  # a dead engine's last numbers would pass for live ones
        engine = self.service.supervisor.engine
        # an unloaded model runs nothing and holds nothing
        stats = engine.stats() if self.service.supervisor.loaded else EngineStats(engine.model_name, engine.device)
        text = metrics_text(stats, self.service.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def authorize(self, request: Request, key: bool = True) -> None:
        self.check_origin(request)
        if self.check_host and host_name(request.headers.get("host", "")) not in LOOPBACK_HOSTS:
            raise APIError(
                403,
                f"this server answers requests for {', '.join(sorted(LOOPBACK_HOSTS))} only, not for "
                f"{request.headers.get('host', 'no host')!r}: use one of those, or serve with --api-key",
                code="host_not_allowed",
            )
        if not key or self.api_key is None:
            return
        local = self.announcer is not None and self.is_key(request, self.announcer.key)
        if not local and not self.is_key(request, self.api_key):
            raise APIError(
                401, "Incorrect API key provided: give the server's key as a bearer token", code="invalid_api_key"
            )

    def check_origin(self, request: Request) -> None:
        """A browser names the page that sends a request in Origin, and sends a cross-origin POST with a text/plain
        body without asking first: a web page must not drive the server unless it is the server's own or allowed
        (as ollama's OLLAMA_ORIGINS). Clients that are not browsers send no Origin."""
        origin = request.headers.get("origin")
        if origin is None or "*" in self.service.allowed_origins or origin in self.service.allowed_origins:
            return
        if origin.removeprefix("http://").removeprefix("https://") != request.headers.get("host"):
            raise APIError(
                403,
                f"requests from web pages at {origin!r} are refused: serve with --allowed-origins {origin} to "
                "allow them",
                code="origin_not_allowed",
            )

    @staticmethod
    def is_key(request: Request, key: str) -> bool:
        given = bearer_token(request.headers.get("authorization", "")) or ""
        return secrets.compare_digest(given.encode(), key.encode())

    def check_engine(self) -> None:
        if not self.service.supervisor.alive:
            raise APIError(503, "the engine is restarting after a failure: retry in a few seconds", kind="server_error")

    async def answer(self, request: Request, chat: bool) -> Response:
        """A completion, or an error object for whatever failed: the connection stays open."""
        try:
            with self.service.keep_alive.request():
                return await self.complete(request, chat)
        except APIError:
            raise
        except ClientDisconnect:  # it left before its body arrived: no one to answer
            return Response(status_code=499)
        except Exception as e:  # not foreseen: still an error object, on a connection that stays open
            log.exception("a request failed")
            raise APIError(
                500, f"the server failed on this request ({type(e).__name__}: {e})", kind="server_error"
            ) from e

    async def complete(self, request: Request, chat: bool) -> Response:
        self.authorize(request)
        if self.service.draining:
            raise shutting_down()
        self.check_engine()
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":  # (a form or text/plain body is what a page sends without asking)
            raise APIError(
                415, f"the body must be JSON sent as Content-Type: application/json, not {media_type or 'none'!r}"
            )
        engine, load_s = await self.service.keep_alive.engine()
        body = parse_json(await read_body_in_time(request, engine))
        preset = self.service.preset
        defaults = engine.sampling_defaults if preset is None else preset.server_defaults(engine.sampling_defaults)
        req = parse_request(body, engine.model_name, engine.max_context, chat, defaults)
        if preset is not None and preset.system and chat:
            req = with_system(req, preset.system)
        if req.params.grammar is not None:
            await run_in_threadpool(check_grammar, req.params.grammar, req.grammar_field)
        if req.with_tools:
            req = await run_in_threadpool(with_tool_prompt, engine, req)
        streams = await submit(engine, req, chat)
        try:
            queue = self.service.pump.watch(streams)
        except APIError:
            cancel_all(engine, streams)
            raise
        asked = req.params.logprobs is not None
        responder = Responder(engine.model_name, chat, engine.tokenizer.token_bytes if asked else None, req.token_ids)
        choices = [Choice(stream) for stream in streams]
        if req.stream:
            events = stream_events(queue, choices, responder, req.include_usage)
            response: Response = EngineStreamResponse(events, engine, streams)
        else:
            response = await whole_reply(request, engine, queue, choices, responder, asked, req.reads_calls)
        if load_s is not None:  # the model had been unloaded (--keep-alive): what loading it again cost this request
            response.headers[LOAD_HEADER] = f"{load_s:.3f}"
        return response


def with_system(req: Completion, system: str) -> Completion:
    """A chat request under the preset's system prompt, where it gives none of its own."""
    assert isinstance(req.prompt, list)  # a chat's messages
    if any(m["role"] == "system" for m in req.prompt):
        return req
    return replace(req, prompt=[{"role": "system", "content": system}, *req.prompt])


def with_tool_prompt(engine: SupervisedEngine, req: Completion) -> Completion:
    """The request with its messages and tools as its chat template takes them (its calls and their replies too),
    the grammar its tool_choice asks for, and the family of calls its reply is read for (engine/tool_calls.py).
    The engine renders the prompt, so a template that leaves a thinking block open starts the reply with its tag
    as it does without tools."""
    from llamaterm.engine import tool_calls  # noqa: PLC0415 (llguidance, when tools come)

    tokenizer = engine.tokenizer
    fmt = tool_calls.tool_format(tokenizer.chat_template)
    assert isinstance(req.prompt, list)  # chat: tools were refused on completions
    messages, tools = tool_calls.for_template(req.prompt, req.tools, fmt)
    req = replace(req, prompt=messages, template_tools=tools, call_family=fmt.family if req.reads_calls else None)
    if req.tools is not None and req.tool_choice not in ("none", "auto"):
        name = req.tool_choice.name if isinstance(req.tool_choice, NamedTool) else None
        parallel = name is None and req.parallel_tool_calls  # a named function: one call to it, as vLLM forces it
        grammar = tool_calls.call_grammar(fmt, req.tools, name, parallel, tokenizer.token_id)
        req = replace(req, params=replace(req.params, grammar=grammar), grammar_field="tools")
    return req


def bearer_token(authorization: str) -> str | None:
    """The token of an 'Authorization: Bearer TOKEN' header (the scheme in any case), or None."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def host_name(host: str) -> str:
    """A Host header's name, without its port: 'localhost:8000' -> 'localhost', '[::1]:8000' -> '[::1]'."""
    host = host.lower()
    return host[: host.find("]") + 1] if host.startswith("[") else host.partition(":")[0]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes. Past that, the rest is read and dropped, up to LINGER_BYTES more, before
    the 413: a client still sending its body reads the answer then, where a connection closed on unread bytes
    would reach it as a reset. A body declared longer than that gets its 413 at once."""
    if int(request.headers.get("content-length") or 0) > limit + LINGER_BYTES:  # h11 has checked it is a number
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit + LINGER_BYTES:
            break
    if size > limit:
        raise too_large(limit)
    return b"".join(chunks)


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is over {limit} bytes, more than any prompt that fits: shorten it", close=True
    )


async def read_body_in_time(request: Request, engine: EngineClient) -> bytes:
    """The body, within BODY_TIMEOUT_S and as long as the longest prompt the engine's context can take."""
    try:
        return await asyncio.wait_for(read_body(request, body_limit(engine.max_context)), BODY_TIMEOUT_S)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {BODY_TIMEOUT_S} s: send it whole", close=True
        ) from None


async def submit(engine: SupervisedEngine, req: Completion, chat: bool) -> list[RequestStream]:
    """The request submitted, once a choice (a seeded request's choices take the seeds that follow its own), one
    right after another so that the engine takes them in one step and forks them from one prefill (the prompt is
    tokenized once: the encoder caches it); a refusal as the API's error, and nothing left running."""
    submitting = asyncio.ensure_future(run_in_threadpool(submit_choices, engine, req))
    try:
        return await asyncio.shield(submitting)
    except asyncio.CancelledError:  # the client left: the choices are cancelled once submitted
        submitting.add_done_callback(partial(cancel_submitted, engine))
        raise
    except grammar.GrammarError as e:  # one only the model's vocabulary refuses
        raise APIError(400, f"{req.grammar_field}: {e}", req.grammar_field) from None
    except RequestError as e:
        code = "context_length_exceeded" if "context" in str(e) or "pool" in str(e) else None
        param = "logit_bias" if str(e).startswith("logit_bias") else "messages" if chat else "prompt"
        raise APIError(400, str(e), param, code) from None
    except LlamatermError as e:
        raise APIError(503, str(e), kind="server_error") from None


def cancel_submitted(engine: EngineClient, submitting: asyncio.Future[list[RequestStream]]) -> None:
    if not submitting.cancelled() and submitting.exception() is None:
        cancel_all(engine, submitting.result())


def submit_choices(engine: SupervisedEngine, req: Completion) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        with engine.together():
            for i in range(req.n):
                seed = req.params.seed
                params = req.params if seed is None else replace(req.params, seed=(seed + i) % 2**64)
                streams.append(
                    engine.submit(
                        req.prompt,
                        params,
                        raw=req.raw,
                        enable_thinking=req.enable_thinking,
                        parse_special=req.parse_special,
                        tools=req.template_tools,
                        tool_calls=req.call_family,
                    )
                )
    except BaseException:
        cancel_all(engine, streams)
        raise
    return streams
