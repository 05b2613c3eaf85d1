"""A request's body parsed and checked: pure functions of the body, before any tokenizing. Requests are bounded in
size (body, prompt bytes, stop strings) and every field is checked, as OpenAI's API checks them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from llamaterm.app.server.errors import APIError
from llamaterm.app.server.grammars import GRAMMAR_FIELDS, parse_grammar
from llamaterm.engine.checkpoints.sampling_defaults import SamplingDefaults
from llamaterm.engine.sampling_params import MAX_BIAS, MAX_LOGPROBS, SamplingError, SamplingParams

COMPLETION_MAX_TOKENS = 16  # a text completion's max_tokens where the request gives none, as OpenAI's API says
PROMPT_BYTES_PER_TOKEN = 16  # a prompt of more UTF-8 bytes than this per token of context cannot fit: refused unread
BODY_SLACK_BYTES = 1 << 20  # a body may hold this much besides its prompt, which JSON's escapes make 6 bytes a byte
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
FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
INTS = ["top_k", "seed"]


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
    call_family: str | None = None  # the syntax of calls its reply is read for, where it reads them (with_tool_prompt)
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


@dataclass(frozen=True)
class NamedTool:
    """A tool_choice that names the function to call (a tool may be called "auto")."""

    name: str


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
