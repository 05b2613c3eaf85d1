"""`llamaterm serve`: one engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn).

/v1/models, /v1/chat/completions and /v1/completions, streamed (server-sent events) or not; /health; /metrics
(the engine's stats in Prometheus' text format). Every client's requests go to the one engine, which batches them.

The engine's events arrive on thread-safe queues. One pump task moves them onto asyncio queues every PUMP_S, so a
waiting stream holds no thread and the event loop never blocks; submits (tokenizing, a pipe round trip) run in
the thread pool. A client that disconnects cancels its request, which frees its KV blocks.

The server guards the engine and itself: a supervisor restarts an engine process that dies (and stops the server
after MAX_FAILURES in FAILURE_WINDOW_S); a SIGTERM or SIGINT drains the requests in flight for a bounded time;
requests are bounded in time (headers, body) and size (body, prompt bytes, stop strings) before any tokenizing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from llamaterm.app.announcements import Announcer, proof
from llamaterm.app.openai_shapes import Responder
from llamaterm.engine.api import EngineClient, EngineStats, Event, RequestStream, TokenLogprob
from llamaterm.engine.checkpoints.sampling_defaults import SamplingDefaults
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import MAX_BIAS, MAX_LOGPROBS, Grammar, SamplingError, SamplingParams
from llamaterm.engine.serving import grammar

if TYPE_CHECKING:
    from llamaterm.engine.checkpoints.tokenizer import Tokenizer
    from llamaterm.engine.tool_calls import ToolCallStream

PUMP_S = 0.01  # how often the live requests' events are collected (the engine process sends one message per step)
COMPLETION_MAX_TOKENS = 16  # a text completion's max_tokens where the request gives none, as OpenAI's API says
DISCONNECT_CHECK_S = 0.5  # how often a non-streaming request looks for a client that left
WATCH_S = 0.05  # how often the supervisor looks for an engine that exited
MAX_FAILURES, FAILURE_WINDOW_S = 3, 600  # this many engine failures in the window stop the server
HEADERS_TIMEOUT_S = 10  # a request's line and headers must arrive within this of the connection or the last response
BODY_TIMEOUT_S = 30  # and its body within this of its headers
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this
SHUTDOWN_GRACE_S = 2  # once a drain has ended the requests, how long their last bytes may take to go out
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers longer than this get 400
PROMPT_BYTES_PER_TOKEN = 16  # a prompt of more UTF-8 bytes than this per token of context cannot fit: refused unread
BODY_SLACK_BYTES = 1 << 20  # a body may hold this much besides its prompt, which JSON's escapes make 6 bytes a byte
LINGER_BYTES = 8 << 20  # of a body over its limit, how much more is read and dropped before the 413
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # --host values that take connections from this machine only
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}  # the names a request to them gives in its Host header
DONE = "data: [DONE]\n\n"
log = logging.getLogger("uvicorn.error")  # uvicorn prints it
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
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
ONLY_DEFAULT: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
MAX_N = 16  # choices a request may ask for (n): they share the prompt's computation (engine/serving/scheduler.py)
# Fields that constrain the reply to a grammar: OpenAI's response_format; vLLM's structured_outputs and, from
# before vLLM 0.12, its guided_* fields; SGLang's regex and ebnf. One a request, at most
GRAMMAR_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "regex",
    "ebnf",
)
# What each of vLLM's and SGLang's fields holds (structured_outputs: one of these keys)
CONSTRAINTS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",
    "ebnf": "grammar",
}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
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
        close: bool = False,  # the body was not read: the connection cannot take another request
    ):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
        self.headers = {"Connection": "close"} if close else None

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class Completion:
    """A parsed request: what to submit and how to answer."""

    prompt: list[dict] | str
    raw: bool  # a /v1/completions prompt: no chat template
    params: SamplingParams
    stream: bool
    include_usage: bool
    enable_thinking: bool | None = None  # the chat template's thinking switch (None: the template's default)
    grammar_field: str | None = None  # the field that gave params.grammar, which its refusal names
    tools: list[dict] | None = None  # OpenAI's function tools, checked
    tool_choice: str | NamedTool | None = None  # "none", "auto", "required" or a tool by name (None: no tools)
    parallel_tool_calls: bool = False  # in a forced call's grammar: several calls, where the client asks
    template_tools: list[dict] | None = None  # the tools as its chat template takes them (with_tool_prompt)
    n: int = 1  # choices, each its own request to the engine
    parse_special: bool = True  # a raw prompt's special-token text becomes those tokens (False: plain text)
    token_ids: bool = False  # each choice carries its tokens' ids (vLLM's return_token_ids)

    @property
    def with_tools(self) -> bool:
        """Rendered through the tool path: tools given, or a conversation that holds calls and their replies."""
        return self.tools is not None or (
            isinstance(self.prompt, list) and any(m["role"] == "tool" or "tool_calls" in m for m in self.prompt)
        )

    @property
    def reads_calls(self) -> bool:
        """The reply is read for calls (tool_choice "none" keeps the tools in the prompt, as vLLM does, and the
        reply as text)."""
        return self.tools is not None and self.tool_choice != "none"


# ---- request parsing: pure functions of the body ----


def body_limit(max_context: int) -> int:
    """The most bytes a request body may take: the longest prompt that can fit, every byte of it escaped."""
    return BODY_SLACK_BYTES + 6 * PROMPT_BYTES_PER_TOKEN * max_context


def parse_json(body: bytes) -> object:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8, or an int past Python's 4,300 digits
        detail = "it is nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise APIError(400, f"We could not parse the JSON body of your request ({detail}): send valid JSON") from None
    check_text(value)
    return value


def check_text(value: object) -> None:
    """Refuse strings, keys too, that are not Unicode text (a lone surrogate, JSON's "\\ud800"): they can be
    neither tokenized nor written back in a reply."""
    todo = [value]
    while todo:  # not recursive: JSON may nest as deep as the parser allows
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError as e:
                raise APIError(
                    400, f"the request holds text that is not valid Unicode ({item[e.start]!r}): send UTF-8 text"
                ) from None
        elif isinstance(item, dict):
            todo += [*item, *item.values()]
        elif isinstance(item, list):
            todo += item


def parse_request(
    body: object, model_name: str, max_context: int, chat: bool, defaults: SamplingDefaults
) -> Completion:
    """The request, its absent sampling fields filled from the model's defaults (as vLLM fills them from
    generation_config.json)."""
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
    check_prompt_bytes(prompt, max_context, "messages" if chat else "prompt")
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise APIError(400, "stream must be true or false and stream_options an object", "stream")
    params = parse_params(body, max_context, chat, defaults)
    reply_grammar, field = parse_grammar(body)
    tools, tool_choice, parallel = parse_tools(body, chat)
    if field is not None and tool_choice not in (None, "none", "auto"):
        raise APIError(400, f"tool_choice and {field} each constrain the reply: give one", field)
    return Completion(
        prompt,
        not chat,
        replace(params, grammar=reply_grammar),
        stream,
        bool(options.get("include_usage")),
        parse_thinking(body.get("chat_template_kwargs"), chat),
        field,
        tools,
        tool_choice,
        parallel,
        n=parse_n(body.get("n")),
        parse_special=parse_special(body.get("parse_special"), chat),
        token_ids=parse_token_ids(body.get("return_token_ids")),
    )


@dataclass(frozen=True)
class NamedTool:
    """A tool_choice that names the function to call (a tool may be called "auto")."""

    name: str


def parse_tools(body: dict, chat: bool) -> tuple[list[dict] | None, str | NamedTool | None, bool]:
    """tools, tool_choice and parallel_tool_calls: (the tools, checked, the schemas of those a grammar forces a call
    to enforceable (engine/tool_calls.py check_tools); "none", "auto", "required" or a tool's name;
    whether a forced reply may hold several calls). A reply read freely ("auto") may hold several calls whatever
    parallel_tool_calls says. Forced, several are allowed only where the client asks (llama.cpp's server's
    default, not OpenAI's): a small model, once allowed another call, repeats its first until max_tokens."""
    from llamaterm.engine.tool_calls import ToolError, check_tools  # noqa: PLC0415 (llguidance, when tools come)

    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice {choice!r} needs tools: give them", "tool_choice")
        return None, None, parallel
    if not chat:
        raise APIError(400, "tools are taken by chat completions only", "tools")
    if choice is None or choice in ("none", "auto", "required"):
        choice = choice or "auto"
    else:
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or choice.get("type") != "function":
            raise APIError(
                400,
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        choice = NamedTool(name)
    try:  # the schemas a grammar enforces: every tool's where a call is required, the named tool's
        checked = check_tools(tools, enforced=lambda name: choice in ("required", NamedTool(name)))
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    names = [t["function"]["name"] for t in checked]
    if isinstance(choice, NamedTool) and choice.name not in names:
        message = f"tool_choice names {choice.name!r}, which is not in tools ({', '.join(names)})"
        raise APIError(400, message, "tool_choice")
    return checked, choice, parallel


def parse_special(value: object, chat: bool) -> bool:
    """Whether a /v1/completions prompt's special-token text ('<|im_start|>') becomes those tokens (the default,
    as vLLM and llama.cpp's server read it) or stays text. A chat message's content is always text: the field is
    refused there, whatever it says."""
    if value is None:
        return True
    if chat:
        raise APIError(
            400, "parse_special is for /v1/completions: a chat message's content is always text", "parse_special"
        )
    if not isinstance(value, bool):
        raise APIError(400, "parse_special must be true or false", "parse_special")
    return value


def parse_token_ids(value: object) -> bool:
    """vLLM's return_token_ids: each choice's token ids beside its text (`token_ids`; in a stream, each chunk's)."""
    if not isinstance(value, bool | None):
        raise APIError(400, "return_token_ids must be true or false", "return_token_ids")
    return bool(value)


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


def check_prompt_bytes(prompt: list[dict] | str, max_context: int, param: str) -> None:
    """Refuse, before it is tokenized, a prompt too long to fit in any tokenizing."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    texts += [json.dumps(m["tool_calls"]) for m in prompt if isinstance(m, dict) and "tool_calls" in m]
    size, limit = sum(len(t.encode()) for t in texts), PROMPT_BYTES_PER_TOKEN * max_context
    if size > limit:
        raise APIError(
            400,
            f"the prompt is {size} bytes, more than the {limit} that can fit in the model's {max_context}-token "
            f"context ({PROMPT_BYTES_PER_TOKEN} bytes a token at most): shorten the prompt",
            param,
            "context_length_exceeded",
        )


def parse_messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}", f"messages[{i}].role"
            )
        if ROLES[role] == "tool":
            out.append(tool_reply(m, i))
        elif role == "assistant" and m.get("tool_calls"):
            content = None if m.get("content") is None else message_text(m["content"], i)
            out.append({"role": "assistant", "content": content or "", "tool_calls": tool_calls(m["tool_calls"], i)})
        else:
            out.append({"role": ROLES[role], "content": message_text(m.get("content"), i)})
    return out


def tool_reply(m: dict, i: int) -> dict:
    """A tool's reply: its call's id and its text."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        where = f"messages[{i}].tool_call_id"
        raise APIError(400, f"messages[{i}] is a tool's reply: it needs the tool_call_id of its call", where)
    return {"role": "tool", "tool_call_id": call_id, "content": message_text(m.get("content"), i)}


def tool_calls(calls: object, i: int) -> list[dict]:
    """An assistant message's calls, as OpenAI sends them back: id, type "function", name, arguments (a JSON
    object as text)."""
    from llamaterm.engine.tool_calls import MAX_NESTING, nesting  # noqa: PLC0415 (llguidance, when tools come)

    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be an array of calls", where)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
            whole = isinstance(parsed, dict) and nesting(parsed) <= MAX_NESTING
        except (ValueError, RecursionError):
            whole = False
        if not (isinstance(call, dict) and isinstance(call.get("id"), str) and isinstance(name, str) and whole):
            raise APIError(
                400,
                f'{where}[{j}] must be {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": '
                f'"a JSON object as text, nested at most {MAX_NESTING} deep"}}}}',
                f"{where}[{j}]",
            )
        out.append({"id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments}})
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


def parse_params(body: dict, max_context: int, chat: bool, defaults: SamplingDefaults) -> SamplingParams:
    check_fields(body)
    values: dict[str, Any] = numbers(body)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field)
    if max_tokens is None:  # OpenAI's: a chat reply runs to the end of the context, a text completion 16 tokens
        max_tokens = max_context if chat else COMPLETION_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_context:
        raise APIError(
            400,
            f"{field} must be a whole number from 1 to {max_context} (the model's context), not {max_tokens!r}",
            field,
        )
    values["max_tokens"] = max_tokens
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or an array of strings", "stop")
    if not isinstance(body.get("ignore_eos", False), bool):
        raise APIError(400, "ignore_eos must be true or false", "ignore_eos")
    values["logprobs"] = parse_logprobs(body, chat)
    values["logit_bias"] = parse_logit_bias(body.get("logit_bias"))
    try:
        return defaults.params(values | {"stop": tuple(stop), "ignore_eos": body.get("ignore_eos", False)})
    except SamplingError as e:
        raise APIError(400, str(e), e.field) from None


def parse_n(value: object) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise APIError(400, f"n must be a whole number from 1 to {MAX_N}, not {value!r}", "n")
    return value


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """SamplingParams.logprobs: chat's logprobs (true or false) and top_logprobs (0-20, with logprobs); a text
    completion's logprobs (how many alternatives, 0-20)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if wanted is not None and not isinstance(wanted, bool):
            raise APIError(400, "logprobs must be true or false", "logprobs")
        if top is not None and not wanted:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        field, count = "top_logprobs", top if wanted else None
    else:
        if top is not None:
            raise APIError(
                400, "top_logprobs is a chat field: text completions take logprobs (a count)", "top_logprobs"
            )
        field, count = "logprobs", wanted
    if count is None:
        return 0 if wanted is True else None
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LOGPROBS:
        raise APIError(400, f"{field} must be a whole number from 0 to {MAX_LOGPROBS}, not {count!r}", field)
    return count


def parse_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases in [-100, 100]; the ids are checked against the model's
    vocabulary when the request is submitted."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise APIError(400, "logit_bias must be an object of token ids to numbers", "logit_bias")
    out = []
    for key, bias in value.items():
        if not re.fullmatch("[0-9]{1,9}", key):
            raise APIError(400, f"logit_bias keys are token ids, not {key[:40]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise APIError(400, f"logit_bias values are numbers from -100 to 100, not {bias!r}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def check_fields(body: dict) -> None:
    """Refuse a field the API does not know, and one asking for what the engine lacks."""
    known = (
        IGNORED
        | ONLY_DEFAULT.keys()
        | set(GRAMMAR_FIELDS)
        | set(FLOATS)
        | set(INTS)
        | {"max_tokens", "max_completion_tokens", "stop", "ignore_eos", "tools", "tool_choice", "parallel_tool_calls"}
        | {"n", "logprobs", "top_logprobs", "logit_bias", "parse_special", "return_token_ids"}
    )
    for name in body:
        if name not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", name)
    for name, defaults in ONLY_DEFAULT.items():
        if name in body and body[name] not in defaults:
            raise APIError(400, f"{name} = {body[name]!r} is not supported by this server", name)


def numbers(body: dict) -> dict:
    """The sampling numbers the body gives (FLOATS and INTS), each checked to be one."""
    values = {}
    for name in FLOATS + INTS:
        value = body.get(name)
        if value is None:
            continue
        kinds = (int, float) if name in FLOATS else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise APIError(400, f"{name} must be a {'number' if name in FLOATS else 'whole number'}", name)
        values[name] = value
    return values


# ---- structured output: the grammar a reply must match ----


def parse_grammar(body: dict) -> tuple[Grammar | None, str | None]:
    """The grammar the body's fields ask for (None: none), and the field that asks."""
    found = [(name, field_grammar(name, body[name])) for name in GRAMMAR_FIELDS if body.get(name) is not None]
    found = [(name, g) for name, g in found if g is not None]
    if len(found) > 1:
        names, second = " and ".join(name for name, _ in found), found[1][0]
        raise APIError(400, f"{second}: {names} each constrain the reply: give one of them", second)
    return (found[0][1], found[0][0]) if found else (None, None)


def field_grammar(field: str, value: object) -> Grammar | None:
    try:
        if field == "response_format":
            return response_format_grammar(value)
        if field == "structured_outputs":
            return structured_outputs_grammar(value)
        return constraint(CONSTRAINTS[field], value)
    except RequestError as e:
        raise APIError(400, f"{field}: {e}", field) from None


def response_format_grammar(value: object) -> Grammar | None:
    """OpenAI's response_format: {"type": "text"} (free), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. strict or not, the
    schema is enforced: every token is sampled within it."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json")
    spec = value.get("json_schema") if isinstance(value, dict) and kind == "json_schema" else None
    if not isinstance(spec, dict):
        raise RequestError(
            'give {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": '
            '..., "schema": {...}}}'
        )
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("strict", False), bool | None):
        raise RequestError("json_schema takes a name (a string), a schema (an object) and strict (true or false)")
    schema = spec.get("schema")
    if schema is None:
        return Grammar("json")
    if not isinstance(schema, dict):
        raise RequestError("json_schema.schema must be a JSON Schema object")
    return Grammar("json_schema", json.dumps(schema))


def structured_outputs_grammar(value: object) -> Grammar:
    """vLLM's structured_outputs: an object with one of json, regex, choice, grammar or json_object."""
    if not isinstance(value, dict):
        value = {}
    given = [k for k, v in value.items() if v is not None]
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUTS:
        raise RequestError(f"give an object with one of {', '.join(STRUCTURED_OUTPUTS)}")
    if given[0] == "json_object":
        if value["json_object"] is not True:
            raise RequestError("json_object must be true")
        return Grammar("json")
    return constraint(given[0], value[given[0]], f"{given[0]} ")


def constraint(kind: str, value: object, where: str = "") -> Grammar:
    """A JSON schema (an object, or its text), a regular expression, a choice of strings, or a grammar (Lark, or
    llama.cpp's GBNF) as vLLM and SGLang take them."""
    if kind == "json" and isinstance(value, dict | str):
        return Grammar("json_schema", value if isinstance(value, str) else json.dumps(value))
    if kind == "regex" and isinstance(value, str):
        return Grammar("regex", value)
    if kind == "choice" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return grammar.choice(value)
    if kind == "grammar" and isinstance(value, str):
        return grammar.lark_from_ebnf(value)
    shapes = {
        "json": "a JSON schema (an object, or its text)",
        "regex": "a regular expression (a string)",
        "choice": "an array of strings",
        "grammar": "a grammar (a string: Lark or GBNF)",
    }
    raise RequestError(f"{where}must be {shapes[kind]}")


def check_grammar(wanted: Grammar, field: str | None) -> None:
    """Refuse a grammar llguidance cannot compile as a 400 naming its field (run in the thread pool: a large
    schema takes milliseconds, and the first of a kind more)."""
    try:
        grammar.check(wanted)
    except RequestError as e:
        raise APIError(400, f"{field}: {e}", field) from None


# ---- engine events to asyncio ----


Events = asyncio.Queue[tuple[int, list[Event]]]  # a response's events: (its choice's index, the events that came)


@dataclass(eq=False)
class Choice:
    """One of a response's n choices, as its events arrive: its own request to the engine, and its reply so far."""

    stream: RequestStream
    calls: ToolCallStream | None  # what reads its reply for tool calls, where it is read for them
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0  # in a stream, the text offset of its next token's log-probabilities
    finish_reason: str | None = None

    def read(self, text: str, final: bool = False) -> tuple[str, list[dict] | None]:
        """A stream's new text: as it is, or less what is a tool call (and the call's deltas)."""
        return (text, None) if self.calls is None else self.calls.push(text, final=final)


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


# ---- the engine's supervision, and the server's stop ----


class SupervisedEngine(EngineClient, Protocol):
    """An engine whose end a server can see (engine/serving/process.py's EngineProcess), and whose tokenizer renders
    the prompts that hold tools."""

    exited: threading.Event  # set once it has exited and its requests have ended with an error event
    tokenizer: Tokenizer

    def submit(
        self,
        prompt: list[dict] | str | None,
        params: SamplingParams | None = None,
        *,
        raw: bool = False,
        enable_thinking: bool | None = None,
        parse_special: bool = True,
        tools: list[dict] | None = None,
    ) -> RequestStream: ...

    @property
    def exitcode(self) -> int | None: ...  # once shut down

    def together(self) -> AbstractContextManager[None]: ...  # requests submitted inside reach the engine together


def cancel_all(engine: EngineClient, streams: list[RequestStream]) -> None:
    """Cancel those still running (a response's choices)."""
    for stream in streams:
        if stream.stats().finished:
            continue
        try:
            engine.cancel(stream)
        except LlamatermError:  # the engine has exited: the request ended with it
            pass


def exit_text(code: int | None) -> str:
    return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"


class EngineSupervisor:
    """The server's engine, kept running. When it exits (its requests have then ended with an error event), the
    child is reaped and `start` builds another with the same config; the MAX_FAILURES-th failure (an exit, or a
    start that failed) within FAILURE_WINDOW_S gives up, and the server exits."""

    def __init__(self, start: Callable[[], SupervisedEngine]):
        self.start = start
        self.engine = start()
        self.restarting = False
        self.gave_up: str | None = None  # why the server must stop
        self.failures: list[float] = []  # their times, within the window

    @property
    def alive(self) -> bool:
        return not self.restarting and not self.engine.exited.is_set()

    async def watch(self) -> None:
        while self.gave_up is None:
            if self.engine.exited.is_set():
                await self.restart()
            await asyncio.sleep(WATCH_S)

    async def restart(self) -> None:
        self.restarting = True
        await run_in_threadpool(self.engine.shutdown)  # reaps the child: no zombie
        problem = f"the engine process exited ({exit_text(self.engine.exitcode)})"
        while not self.too_many_failures(problem):
            log.warning("llamaterm serve: %s: starting it again", problem)
            try:
                self.engine = await run_in_threadpool(self.start)
            except Exception as e:  # the server keeps supervising, whatever the start raised
                problem = f"the engine did not start again ({e})"
                continue
            self.restarting = False
            return

    def too_many_failures(self, problem: str) -> bool:
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < FAILURE_WINDOW_S] + [now]
        if len(self.failures) < MAX_FAILURES:
            return False
        self.gave_up = (
            f"the engine failed {MAX_FAILURES} times in {FAILURE_WINDOW_S // 60} minutes, last: {problem}: "
            "the server stops; see the log above"
        )
        return True

    def __enter__(self) -> EngineSupervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()


class Service:
    """What the routes share with the server's stop: the engine's supervisor, the live requests' events, and
    whether the server drains (refuses new requests while those in flight finish)."""

    def __init__(self, supervisor: EngineSupervisor):
        self.supervisor = supervisor
        self.pump = EventPump()
        self.draining = False

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


# ---- responses ----


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


def create_app(
    service: Service, api_key: str | None = None, host: str = "127.0.0.1", announcer: Announcer | None = None
) -> Starlette:
    """The ASGI app over the service's engine (which the caller owns and shuts down), for a server on `host`; one
    that announces itself (app/announcements.py) takes its local key too."""
    api = Handlers(service, api_key, host, announcer)

    @asynccontextmanager
    async def lifespan(app):
        tasks = [asyncio.create_task(service.pump.run()), asyncio.create_task(service.supervisor.watch())]
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
        status = self.service.status()
        shown = {"status": status, "model": self.service.supervisor.engine.model_name}
        challenge = request.query_params.get("challenge")
        if self.announcer is not None and challenge is not None:
            shown["proof"] = proof(self.announcer.key, challenge)
        return JSONResponse(shown, status_code=200 if status == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        self.authorize(request)
        self.check_engine()  # a dead engine's last numbers would pass for live ones
        stats = self.service.supervisor.engine.stats()
        return PlainTextResponse(metrics_text(stats), media_type="text/plain; version=0.0.4")

    def authorize(self, request: Request, key: bool = True) -> None:
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
        engine = self.service.supervisor.engine
        body = parse_json(await read_body_in_time(request, engine))
        req = parse_request(body, engine.model_name, engine.max_context, chat, engine.sampling_defaults)
        if req.params.grammar is not None:
            await run_in_threadpool(check_grammar, req.params.grammar, req.grammar_field)
        family = reply_family(engine, chat)
        if req.with_tools:
            req, family = await run_in_threadpool(with_tool_prompt, engine, req)
        streams = await submit(engine, req, chat)
        try:
            queue = self.service.pump.watch(streams)
        except APIError:
            cancel_all(engine, streams)
            raise
        asked = req.params.logprobs is not None
        responder = Responder(engine.model_name, chat, engine.tokenizer.token_bytes if asked else None, req.token_ids)
        choices = [Choice(stream, call_reader(family, req)) for stream in streams]
        if req.stream:
            events = stream_events(queue, choices, responder, req.include_usage)
            return EngineStreamResponse(events, engine, streams)
        return await whole_reply(request, engine, queue, choices, responder, asked)


def with_tool_prompt(engine: SupervisedEngine, req: Completion) -> tuple[Completion, str]:
    """The request with its messages and tools as its chat template takes them (its calls and their replies too),
    and the grammar its tool_choice asks for; and the family of calls its reply is read for (engine/tool_calls.py).
    The engine renders the prompt, so a template that leaves a thinking block open starts the reply with its tag
    as it does without tools."""
    from llamaterm.engine import tool_calls  # noqa: PLC0415 (llguidance, when tools come)

    tokenizer = engine.tokenizer
    fmt = tool_calls.tool_format(tokenizer.chat_template)
    assert isinstance(req.prompt, list)  # chat: tools were refused on completions
    messages, tools = tool_calls.for_template(req.prompt, req.tools, fmt)
    req = replace(req, prompt=messages, template_tools=tools)
    if req.tools is not None and req.tool_choice not in ("none", "auto"):
        name = req.tool_choice.name if isinstance(req.tool_choice, NamedTool) else None
        parallel = name is None and req.parallel_tool_calls  # a named function: one call to it, as vLLM forces it
        grammar = tool_calls.call_grammar(fmt, req.tools, name, parallel, tokenizer.token_id)
        req = replace(req, params=replace(req.params, grammar=grammar), grammar_field="tools")
    return req, fmt.family


def reply_family(engine: SupervisedEngine, chat: bool) -> str | None:
    """The family a chat reply is read as without tools: harmony's (gpt-oss), whose thinking and answer are channels
    of the reply (engine/harmony.py); None, text as it is."""
    from llamaterm.engine import harmony, tool_calls  # noqa: PLC0415

    return tool_calls.HARMONY if chat and harmony.speaks_harmony(engine.tokenizer.chat_template.source) else None


def call_reader(family: str | None, req: Completion) -> ToolCallStream | None:
    """What reads the reply for calls, where it is read for them; a harmony reply always, for its channels."""
    from llamaterm.engine.tool_calls import HARMONY, ToolCallStream  # noqa: PLC0415

    if family == HARMONY:
        return ToolCallStream(family, read_calls=req.reads_calls)
    return ToolCallStream(family) if family is not None and req.reads_calls else None


def finish_reason(reason: str | None, calls: ToolCallStream | None) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended with calls."""
    return "tool_calls" if reason == "stop" and calls is not None and calls.ids else reason


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
                    )
                )
    except BaseException:
        cancel_all(engine, streams)
        raise
    return streams


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
        text = "".join(e.text for e in events[:-1])
        logprobs = [lp for e in events for lp in e.logprobs]
        ids = [t for e in events for t in e.token_ids]
        if last.finished and (error := failure(last)) is not None:
            yield (sse(responder.chunk(text, index=i, ids=ids, **extra)) if text else "") + sse(error.body) + DONE
            return
        text, deltas = choice.read(text + last.text, final=last.finished)
        reason = finish_reason(last.finish_reason, choice.calls) if last.finished else None
        if text or deltas or logprobs or reason or (ids and responder.token_ids):
            at = choice.offset  # (a token's text may come in a later chunk: a stop string held it back)
            yield sse(
                responder.chunk(text, reason, calls=deltas, index=i, logprobs=logprobs, offset=at, ids=ids, **extra)
            )
        if logprobs:
            choice.offset += responder.text_length(logprobs)
        running -= last.finished
    if include_usage:
        yield sse(responder.envelope(responder.chunk_kind, [], usage=usage([c.stream for c in choices])))
    yield DONE


async def whole_reply(
    request: Request, engine: EngineClient, queue: Events, choices: list[Choice], responder: Responder, asked: bool
) -> Response:
    """Every choice's whole reply, once all have ended. asked: the request asked for logprobs."""
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
        choice.text += [e.text for e in events]
        choice.logprobs += [lp for e in events for lp in e.logprobs]
        choice.token_ids += [t for e in events for t in e.token_ids]
        if last.finished:
            if (error := failure(last)) is not None:
                cancel_all(engine, streams)
                raise error
            choice.finish_reason, running = last.finish_reason, running - 1
    shown = []
    for i, c in enumerate(choices):
        content, _ = c.read("".join(c.text), final=True)
        found = [call.openai() for call in c.calls.calls()] if c.calls is not None else None
        logprobs = c.logprobs if asked else None
        reason = finish_reason(c.finish_reason, c.calls)
        text = content or None if c.calls is not None else content  # with tools, no text is null, as OpenAI
        shown.append(responder.choice(i, text, reason, found, logprobs, c.token_ids))
    return JSONResponse(responder.whole(shown, usage(streams)))


async def api_error(request: Request, exc: Exception) -> Response:
    return exc.response()  # type: ignore[attr-defined]


async def http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code  # type: ignore[attr-defined]
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed here"}
    return APIError(status, message.get(status, str(exc))).response()


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: send the request to a running server", kind="server_error")


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


class HeadersDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers. uvicorn times out only a connection idle
    after a response, and the next request's first byte stops that clock: a connection that sent nothing, or
    headers a byte at a time, stayed open without end. Here the headers must be whole HEADERS_TIMEOUT_S after the
    connection opens or the last response ends, or the connection closes. (The body's deadline is the app's.)"""

    deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers arrived
            self.disarm()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle:  # no pipelined request began
            self.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(HEADERS_TIMEOUT_S, self.transport.close)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class Server(uvicorn.Server):
    """uvicorn's server on the service, with a bounded drain. uvicorn's own stop closes the socket at the first
    SIGTERM or SIGINT and waits for every response without limit; a second signal cuts them mid-body. Here the
    first starts a drain: new requests get 503 while those in flight may finish for `shutdown_timeout` seconds;
    then, or at a second signal, the rest end with an error event and [DONE], and the server exits. It exits too
    when the supervisor gives up on the engine. With an announcer, it announces itself once it answers."""

    def __init__(
        self,
        service: Service,
        host: str,
        port: int,
        api_key: str | None,
        shutdown_timeout: float = 10,
        announcer: Announcer | None = None,
    ):
        config = uvicorn.Config(
            create_app(service, api_key, host, announcer),
            host=host,
            port=port,
            http=HeadersDeadline,
            log_level="warning",
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        super().__init__(config)
        self.service, self.shutdown_timeout, self.announcer = service, shutdown_timeout, announcer
        self.drain_until: float | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announcer is not None:
            try:
                self.announcer.write()
            except (LlamatermError, OSError) as e:
                log.warning("llamaterm serve: not announced for `llamaterm run` (%s): it serves all the same", e)

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_until is None:
            self.service.draining = True
            self.drain_until = time.monotonic() + self.shutdown_timeout
        else:
            self.drain_until = 0.0

    async def on_tick(self, counter: int) -> bool:
        drained = self.drain_until is not None and (not self.service.pump.live or time.monotonic() > self.drain_until)
        if drained or self.service.supervisor.gave_up:
            self.service.stop()
            self.should_exit = True
        return await super().on_tick(counter)


def serve(
    supervisor: EngineSupervisor,
    host: str,
    port: int,
    api_key: str | None,
    shutdown_timeout: float,
    announcer: Announcer | None = None,
) -> None:
    """Serve until a SIGTERM or SIGINT (Ctrl-C) has drained the server; raises LlamatermError if the engine failed
    too often. The announcement, if any, goes as the server stops answering, however it stops."""
    try:
        Server(Service(supervisor), host, port, api_key, shutdown_timeout, announcer).run()
    finally:
        if announcer is not None:
            announcer.remove()
    if supervisor.gave_up:
        raise LlamatermError(supervisor.gave_up)
