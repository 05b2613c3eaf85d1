"""Tool calls: OpenAI's `tools` rendered by the model's chat template, and the model's reply read back as calls.

A model family writes its calls in its own syntax, which its chat template shows (so the family comes from the
template's text):
- "hermes" (NousResearch's Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block a call;
- "llama3" (Llama 3.1 and later): the reply is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or
  not), calls separated by ';';
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, each call's id 9 letters and digits;
- "harmony" (gpt-oss): a message to the tool, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
  and the arguments (engine/harmony.py); `<|call|>` ends the reply, so it holds one call. Its thinking and answer
  are channels of it too: the content read from it is the answer, the thinking before it in a <think> block, the
  form `serve` gives every model's thinking in.
A template that does not render tools (SmolLM2's ChatML) gets them as Qwen2.5's template writes them, in the
system message, and its calls are read as Hermes' (the convention vLLM's `hermes` parser reads): the conversation's
earlier calls go in the assistant's text as `<tool_call>` blocks, the tools' replies in a user turn as
`<tool_response>` blocks, as Qwen2.5 has them.

A call's arguments are the model's own JSON text of them, whole or streamed, so the streamed pieces add up to the
whole reply's. Text work only: no torch.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llamaterm.engine import harmony
from llamaterm.engine.api import ToolCall, ToolCallDelta
from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import Grammar
from llamaterm.engine.thinking import CLOSE as THINK_CLOSE
from llamaterm.engine.thinking import OPEN as THINK_OPEN

HERMES, LLAMA3, MISTRAL, HARMONY = "hermes", "llama3", "mistral", "harmony"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
PROBE_TOOL = "llamaterm_probe_tool"  # a name no template writes unless it renders the tools it is given
# Compact JSON in forced calls: flexible whitespace would let a weak model write spaces until max_tokens
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_VALUES = {"const", "enum", "default", "examples"}  # keywords whose values are JSON values, not schemas
MAX_NESTING = 64  # of a tool's parameters schema or a call's arguments: real ones nest a few levels


# llguidance's words for a schema that JSON Schema allows but it does not implement (its other errors: not a schema)
UNIMPLEMENTED = re.compile(r"Unimplemented keys|is not supported|Unknown format")


def nesting(value: object) -> int:
    """How deep JSON values nest (dicts and lists), counted without recursion: a request's JSON may nest as deep
    as the parser allows."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo += [(x, depth + 1) for x in (item.values() if isinstance(item, dict) else item)]
    return deepest


class ToolError(RequestError):
    """A request's tools or tool messages refused; param names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolFormat:
    """How a model takes tools: the family of its call syntax, and whether its template renders tools itself."""

    family: str
    native: bool


def new_call_id(family: str) -> str:
    if family == MISTRAL:  # Mistral's templates refuse any other id
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


@functools.lru_cache(maxsize=16)  # a server asks for its model's on every request with tools
def tool_format(template: ChatTemplate) -> ToolFormat:
    """The family from the template's text; native where rendering a tool shows its name."""
    source = template.source
    family = (
        HARMONY
        if harmony.speaks_harmony(source)
        else MISTRAL
        if MISTRAL_CALLS in source
        else LLAMA3
        if "<|start_header_id|>" in source and TOOL_CALL_OPEN not in source
        else HERMES
    )
    probe = {"type": "function", "function": {"name": PROBE_TOOL, "description": "", "parameters": {}}}
    try:
        shown = template.render(
            [{"role": "user", "content": "?"}], add_generation_prompt=True, bos_token="", eos_token="", tools=[probe]
        )
    except LlamatermError:  # it refuses tools: they go in the system message
        shown = ""
    native = PROBE_TOOL in shown
    return ToolFormat(family if native else HERMES, native)


# ---- rendering: the conversation as the template takes it ----


def for_template(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat) -> tuple[list[dict], list | None]:
    """The messages and tools to render. A native template gets the calls' arguments as objects (transformers'
    templates read them so, as vLLM gives them); any other gets the tools in its system message, the calls and
    the tools' replies as text."""
    if fmt.native:
        return [_arguments_as_objects(m) for m in messages], tools
    out: list[dict] = []
    replies: dict | None = None  # the user turn that gathers the replies of consecutive tool messages
    for m in messages:
        if m["role"] == "tool":
            reply = f"<tool_response>\n{m['content']}\n</tool_response>"
            if replies is None:
                replies = {"role": "user", "content": reply}
                out.append(replies)
            else:
                replies["content"] += "\n" + reply
            continue
        replies = None
        if m.get("tool_calls"):
            calls = "".join(
                f"\n{TOOL_CALL_OPEN}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                    ensure_ascii=False,
                )
                + f"\n{TOOL_CALL_CLOSE}"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": ((m.get("content") or "") + calls).lstrip("\n")})
        else:
            out.append(dict(m))
    if tools:
        described = tools_system_text(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def tools_system_text(tools: list[dict]) -> str:
    """The tools as Qwen2.5's template describes them in its system message."""
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CALL_CLOSE
    )


def _arguments_as_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


# ---- grammars: tool_choice "required" and a named function ----


def call_grammar(
    fmt: ToolFormat,
    tools: list[dict],
    name: str | None,
    parallel: bool,
    token_id: Callable[[str], int | None] = lambda text: None,
) -> Grammar:
    """A Lark grammar (llguidance's) forcing a reply of calls in the family's syntax: to the tool `name`, or to
    any of `tools` (one or more where `parallel`; harmony's reply holds one). token_id: the id of the one token a
    marker (`<tool_call>`, `[TOOL_CALLS]`, `<|channel|>`) is in the model's vocabulary, or None where it is text;
    llguidance matches such tokens by id, never by their text."""

    def marker(text: str) -> str:
        found = token_id(text)
        return json.dumps(text) if found is None else f"<[{found}]>"

    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if fmt.family == HARMONY:
        schemas = [(f["name"], {**(f.get("parameters") or {"type": "object"}), "x-guidance": COMPACT}) for f in chosen]
        return Grammar("lark", harmony.call_grammar(schemas, marker))
    key = "parameters" if fmt.family == LLAMA3 else "arguments"
    at = [f"/anyOf/{i}/properties/{key}" if len(chosen) > 1 else f"/properties/{key}" for i in range(len(chosen))]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: rebased(f.get("parameters") or {"type": "object"}, base)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f, base in zip(chosen, at, strict=True)
    ]
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    body = "call: %json" + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)
    if fmt.family == HERMES:
        block = f'{marker(TOOL_CALL_OPEN)} "\\n" call "\\n" {marker(TOOL_CALL_CLOSE)}'
        start = f'start: {block} ("\\n" {block})*' if parallel else f"start: {block}"
    elif fmt.family == MISTRAL:
        opening = f'{marker(MISTRAL_CALLS)} "["'
        start = f'start: {opening} call (", " call)* "]"' if parallel else f'start: {opening} call "]"'
    else:
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return Grammar("lark", f"{start}\n{body}\n")


def rebased(schema: Any, base: str) -> Any:
    """A tool's parameters schema to embed at the JSON pointer `base` of a call's schema: its references within
    itself (`#/$defs/Address`, as pydantic writes a nested model; `#` for itself) point from the new root."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            value = "#" + base + value[1:]
        elif key not in SCHEMA_VALUES:
            value = rebased(value, base)
        out[key] = value
    return out


# ---- parsing: a reply's text -> content and calls ----


@dataclass
class PartialCall:
    name: str | None = None  # once its text is whole
    arguments: str = ""  # the text of the arguments so far
    arguments_at: int = -1  # where they start in the reply's text
    whole: bool = False


@dataclass
class Parsed:
    content: str  # the text outside calls (and, while streaming, not perhaps the start of one)
    calls: list[PartialCall] = field(default_factory=list)


def parse_reply(text: str, family: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (its content, None where empty; its calls, with new ids). A call cut short or malformed
    stays in the content."""
    parsed = parse(text, family, final=True)
    calls = [ToolCall(new_call_id(family), c.name or "", c.arguments) for c in parsed.calls]
    return parsed.content or None, calls


def parse(text: str, family: str, final: bool) -> Parsed:
    """The reply so far: with final=False, text that may still become a call is held back from the content."""
    parsers = {HERMES: _parse_hermes, MISTRAL: _parse_mistral, LLAMA3: _parse_llama3, HARMONY: _parse_harmony}
    return parsers[family](text, final)


def _parse_hermes(text: str, final: bool) -> Parsed:
    parts, calls, i = [], [], 0
    while True:
        k = text.find(TOOL_CALL_OPEN, i)
        if k < 0:
            parts.append(text[i:] if final else _without_marker_start(text[i:], TOOL_CALL_OPEN))
            break
        parts.append(text[i:k])
        found = _calls(text, _skip_ws(text, k + len(TOOL_CALL_OPEN)), final, one=True)
        if found is None:  # not a call after all: the rest is text
            parts.append(text[k:])
            break
        new, end = found
        calls += new
        if end is None:
            break
        after = _skip_ws(text, end)
        i = after + len(TOOL_CALL_CLOSE) if text.startswith(TOOL_CALL_CLOSE, after) else end
        if TOOL_CALL_CLOSE.startswith(text[after:]):  # the closing tag, cut short, or the end
            break
    return Parsed("".join(parts).strip(), calls)


def _parse_mistral(text: str, final: bool) -> Parsed:
    k = text.find(MISTRAL_CALLS)
    if k < 0:
        return Parsed((text if final else _without_marker_start(text, MISTRAL_CALLS)).strip())
    found = _calls(text, _skip_ws(text, k + len(MISTRAL_CALLS)), final, one=False)
    return Parsed(text[:k].strip(), found[0]) if found is not None else Parsed(text.strip())


def _parse_llama3(text: str, final: bool) -> Parsed:
    start = _skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, start):
        start = _skip_ws(text, start + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[start:]):  # nothing yet, or the tag cut short
        return Parsed("")
    if start < len(text) and text[start] != "{":
        return Parsed(text.strip())
    calls: list[PartialCall] = []
    while start < len(text):
        found = _calls(text, start, final, one=True)
        if found is None:
            return Parsed(text.strip())
        calls += found[0]
        if found[1] is None:
            break
        start = _skip_ws(text, found[1])
        if start < len(text) and text[start] == ";":
            start = _skip_ws(text, start + 1)
        elif start < len(text):  # text after whole calls: the calls stand (a stream has sent them), the rest is text
            return Parsed(text[start:].strip(), calls)
    return Parsed("", calls)


def _parse_harmony(text: str, final: bool) -> Parsed:
    """Its messages to functions are the calls (at the end, those whose arguments are a whole JSON object); the
    content is the answer, the thinking before it in a <think> block, closed where the answer begins (or the reply
    ends): as the text grows, the content only grows at its end."""
    messages = harmony.read(text, final)
    calls = [PartialCall(m.name, m.body, m.at, _json_object(m.body)) for m in messages if m.kind == harmony.TOOL_CALL]
    if final:
        calls = [c for c in calls if c.whole]
    parts, thinking, answered = [], False, False
    for m in messages:
        if m.kind == harmony.THINKING and m.body:
            parts += ["\n\n" if thinking else THINK_OPEN, m.body]
            thinking = True
        elif m.kind == harmony.ANSWER and m.body:
            parts += [THINK_CLOSE if thinking else "\n\n" if answered else "", m.body]
            thinking, answered = False, True
    return Parsed("".join(parts) + (THINK_CLOSE if thinking and final else ""), calls)


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _calls(text: str, i: int, final: bool, one: bool) -> tuple[list[PartialCall], int | None] | None:
    """The call object (one=True) or array of them at text[i:], and the index after it (None while it is not
    whole); None where the text is no call (or, with final, not a whole one)."""
    try:
        if i >= len(text):
            calls, end = [], None
        elif one:
            call, end = _call(text, i)
            calls = [call]
        else:
            calls, end = _call_array(text, i)
    except ValueError:
        return None
    if final and (end is None or not all(c.whole for c in calls)):
        return None
    return calls, end


def _call(text: str, i: int) -> tuple[PartialCall, int | None]:
    members, end = _object_members(text, i)
    call = PartialCall()
    if "name" in members and members["name"][1] is not None:
        start, stop = members["name"]
        call.name = json.loads(text[start:stop])
        if not isinstance(call.name, str):
            raise ValueError("a call's name is a string")
    args = members.get("arguments", members.get("parameters"))
    if args is not None:
        start, stop = args
        if text[start] != "{":
            raise ValueError("a call's arguments are an object")
        call.arguments, call.arguments_at = text[start : len(text) if stop is None else stop], start
    if end is not None:
        if call.name is None:
            raise ValueError("a call has a name")
        call.arguments, call.whole = call.arguments or "{}", True
    return call, end


def _call_array(text: str, i: int) -> tuple[list[PartialCall], int | None]:
    if text[i] != "[":
        raise ValueError("calls are an array")
    calls, j = [], _skip_ws(text, i + 1)
    while j < len(text):
        call, end = _call(text, j)
        calls.append(call)
        if end is None:
            return calls, None
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == "]":
            return calls, j + 1
        if j < len(text) and text[j] != ",":
            raise ValueError("calls are separated by commas")
        j = _skip_ws(text, j + 1)
    return calls, None


def _object_members(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object at text[i:], each key -> (its value's start, its end or None while it is not
    whole), and the index after the object (None while it is not whole). ValueError: not a JSON object."""
    if text[i] != "{":
        raise ValueError("not an object")
    members: dict[str, tuple[int, int | None]] = {}
    j = _skip_ws(text, i + 1)
    if text.startswith("}", j):
        return members, j + 1
    while j < len(text):
        if text[j] != '"':
            raise ValueError("a key is a string")
        key_end = _value_end(text, j)
        if key_end is None:
            return members, None
        key, j = json.loads(text[j:key_end]), _skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise ValueError("a key is followed by ':'")
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        value_end = members.setdefault(key, (j, _value_end(text, j)))[1]
        if value_end is None:
            return members, None
        j = _skip_ws(text, value_end)
        if text.startswith("}", j):
            return members, j + 1
        if j < len(text) and text[j] != ",":
            raise ValueError("members are separated by commas")
        j = _skip_ws(text, j + 1)
    return members, None


_SCALAR = re.compile(r"[-+.0-9a-zA-Z]+")


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at text[i], None while it is not whole. ValueError: not JSON."""
    if text[i] in '"{[':
        return _scan(text, Nesting(i + 1, 0, True) if text[i] == '"' else Nesting(i, 0, False))
    scalar = _SCALAR.match(text, i)
    if scalar is None:
        raise ValueError(f"not JSON: {text[i]!r}")
    if scalar.end() == len(text):  # a number or a word may go on
        return None
    json.loads(scalar.group())
    return scalar.end()


@dataclass
class Nesting:
    """How far a reading of a JSON string, object or array has come: the next index to read, the depth of objects
    and arrays open, and whether it is inside a string. A stream's text only grows: its reading goes on from here."""

    at: int
    depth: int
    in_string: bool


def _scan(text: str, n: Nesting) -> int | None:
    """Read text on from n (updated to where the text ends): the index after the value, None while it is not
    whole."""
    j, depth, in_string = n.at, n.depth, n.in_string
    while j < len(text):
        c = text[j]
        if in_string:
            if c == "\\":
                j += 1
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    n.at, n.depth, n.in_string = j, depth, in_string  # (past the end after a backslash: the next text's first
    return None  # character is the one it escapes)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _without_marker_start(text: str, marker: str) -> str:
    """The text less a tail that could be the start of the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


# ---- streaming: text deltas -> content deltas and the calls' pieces ----


class ToolCallStream:
    """One reply's text as it streams, read as the family's calls. push() takes the next text and gives the content
    that can no longer be part of a call, and the calls' pieces as OpenAI's delta.tool_calls streams them: first
    each call's index, id and name, then pieces of its arguments. read_calls=False leaves the calls out (a harmony reply
    read where its request reads none: its content is still a reading of its channels)."""

    def __init__(self, family: str, read_calls: bool = True):
        self.family, self.read_calls = family, read_calls
        self.text, self.content_sent = "", 0
        self.ids: list[str] = []  # of the calls announced
        self.arguments_sent: list[int] = []
        # the last call's arguments while they are not whole and the call is announced: their reading, so that a
        # push inside them reads its own text, not the reply's again (an agent writes whole files as arguments)
        self.open_arguments: Nesting | None = None

    def push(self, delta: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        if self.open_arguments is not None and not final and _scan(self.text, self.open_arguments) is None:
            index = len(self.ids) - 1
            self.arguments_sent[index] += len(delta)
            return "", [ToolCallDelta(index, delta)] if delta else []
        self.open_arguments = None
        parsed = parse(self.text, self.family, final)
        if final and len(parsed.calls) < len(self.ids):  # a call announced, then cut short: it stays a call
            parsed = parse(self.text, self.family, False)
        if not self.read_calls:
            parsed.calls = []
        content = parsed.content[self.content_sent :]  # the content so far only grows: held text comes later
        self.content_sent += len(content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id(self.family))
                self.arguments_sent.append(0)
                deltas.append(ToolCallDelta(index, call.arguments, self.ids[index], call.name))
            elif len(call.arguments) > self.arguments_sent[index]:
                deltas.append(ToolCallDelta(index, call.arguments[self.arguments_sent[index] :]))
            self.arguments_sent[index] = len(call.arguments)
        last = parsed.calls[-1] if parsed.calls else None
        if not final and last is not None and last.arguments and len(parsed.calls) == len(self.ids):
            reading = Nesting(last.arguments_at, 0, False)
            if _scan(self.text, reading) is None:  # (once: later pushes read on from where it stops)
                self.open_arguments = reading
        return content, deltas


def check_tools(tools: object, enforced: Callable[[str], bool] = lambda name: True) -> list[dict]:
    """OpenAI's tools, checked: function tools with distinct names and parameters that are JSON schemas of objects,
    which llguidance can enforce for the tools `enforced` says a grammar holds a call to (tool_choice "required" or
    a named tool); for the others a schema of JSON Schema's that llguidance does not implement (uniqueItems, not,
    if/then, a look-ahead pattern: Pydantic's sets and many MCP tools have them) is the template's to show, as
    OpenAI takes it for tools that are not strict. ToolError names the field."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty array of function tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = _check_tool(tool, f"tools[{i}]", enforced)
        if name in names:
            raise ToolError(f"tools[{i}]: {name!r} is the name of another tool: names must differ", f"tools[{i}]")
        names.add(name)
    return tools


def _check_tool(tool: object, where: str, enforced: Callable[[str], bool]) -> str:
    from llguidance import LLMatcher  # noqa: PLC0415 (its native library loads only when tools come)

    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise ToolError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, _ . or -", f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
    params, field_name = function.get("parameters", {"type": "object"}), f"{where}.function.parameters"
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolError(f"{field_name} must be a JSON schema of an object", field_name)
    if nesting(params) > MAX_NESTING:
        raise ToolError(f"{field_name} nests deeper than {MAX_NESTING} levels", field_name)
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(params))
    if error and (enforced(name) or not UNIMPLEMENTED.search(error)):
        raise ToolError(f"{field_name} is not a JSON schema this server can enforce: {error}", field_name)
    return name
