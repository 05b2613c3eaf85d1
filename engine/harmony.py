"""Harmony, the chat format of OpenAI's gpt-oss models: their replies read as thinking, an answer and tool calls; the
conversation shaped as their chat template takes it; the grammar that forces a call.

A reply is a run of messages that follows the prompt's `<|start|>assistant`, each a header, `<|message|>`, a body and
an end (the spec: openai/harmony, docs/format.md):

    <|channel|>analysis<|message|>The user asks...<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>

The header's channel says whose the body is: `analysis` is the model's thinking, `final` (and `commentary` with no
recipient, a preamble) the answer. A header that names a recipient, before or after the channel
(`<|channel|>commentary to=functions.get_weather <|constrain|>json`, `<|start|>assistant to=functions.get_weather
<|channel|>commentary json`), makes the body a message to that tool: to `functions.NAME`, a call whose arguments are
the body; to another (a built-in tool the model was not given), nobody's text. `<|return|>` and `<|call|>` end the
reply (they are stop tokens: their text never reaches a reader), `<|end|>` only its message.

These markers are special tokens, and the engine's detokenizer writes special tokens out as their text (it skips
none), so a reply's text holds its structure and is read here as text, as llama.cpp's parser reads it: the same
reader then serves a remote server's text. Text that is no harmony message (a reply a grammar forced into JSON) is
answer text. Text work only: no torch.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"  # <|end|> ends a message; <|call|>, <|return|> the reply
ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."  # the namespace the template gives a request's tools
# how a message's header begins: the first message's right after the prompt's <|start|>assistant
OPENERS = (START, CHANNEL, " to=")
THINKING, ANSWER, TOOL_CALL, NOBODY = "thinking", "answer", "call", "nobody"  # whose a message's body is

_ROLE = re.compile(r"<\|start\|>([^\s<]*)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>([^\s<]*)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def speaks_harmony(template_source: str) -> bool:
    """Whether a chat template is harmony's, as llama.cpp tells it: it writes channels."""
    return CHANNEL in template_source


@dataclass
class Message:
    kind: str  # THINKING, ANSWER, TOOL_CALL or NOBODY
    name: str  # the function a call is to
    at: int  # where the body starts in the reply's text
    body: str = ""  # as far as it came
    whole: bool = False  # its end marker came
    plain: bool = False  # text that is no harmony message: the answer, to the reply's end


class Reader:
    """A reply's messages as its text arrives: push() takes the next text and gives each message's new body text.
    It keeps only what it cannot read yet: a header until its <|message|>, a body's tail that may begin an end
    marker (text can arrive cut anywhere: a stop string's look-ahead holds some back). At the end (final), that
    tail is body, and a header cut short is dropped: it has no body."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.held = ""  # the text not read yet
        self.at = 0  # where it starts in the reply's text

    def push(self, delta: str, final: bool = False) -> list[tuple[Message, str]]:
        self.held += delta
        pieces = []
        while self.held and (self._open() or self._begin(final)):
            m = self.messages[-1]
            ends = [] if m.plain else [(j, e) for e in ENDS if (j := self.held.find(e)) >= 0]
            end, marker = min(ends) if ends else (len(self.held), "")
            if not (ends or final or m.plain):
                end -= _end_start(self.held)
            m.body += self.held[:end]
            m.whole = bool(ends)
            pieces.append((m, self.held[:end]))
            self._consume(end + len(marker))
            if not ends:
                break
        return pieces

    def _open(self) -> bool:
        return bool(self.messages) and not self.messages[-1].whole

    def _begin(self, final: bool) -> bool:
        """Start the next message, where its header is whole (or the text is no harmony)."""
        if not self.held.startswith(OPENERS):
            if not final and any(o.startswith(self.held) for o in OPENERS):
                return False  # may still open a header
            self.messages.append(Message(ANSWER, "", self.at, plain=True))
            return True
        k = self.held.find(MESSAGE)
        if k < 0:
            return False
        kind, name = _kind(self.held[:k])
        self._consume(k + len(MESSAGE))
        self.messages.append(Message(kind, name, self.at))
        return True

    def _consume(self, n: int) -> None:
        self.held, self.at = self.held[n:], self.at + n


def read(text: str, final: bool) -> list[Message]:
    """The messages of a whole reply, or of one as far as it came (final=False)."""
    reader = Reader()
    reader.push(text, final)
    return reader.messages


def _kind(header: str) -> tuple[str, str]:
    """Whose a message is, from its header: (kind, the function called). A recipient `assistant` is the model itself
    (gpt-oss-20b sometimes writes `<|channel|>commentary to=assistant` before its real channel: the last one counts,
    as llama.cpp reads it)."""
    recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
    if recipients:
        name = recipients[0].removeprefix(FUNCTIONS)
        return (TOOL_CALL, name) if recipients[0].startswith(FUNCTIONS) and name else (NOBODY, "")
    role = _ROLE.match(header)
    if role is not None and role.group(1) != "assistant":  # the model writing another's turn
        return NOBODY, ""
    channels = _CHANNEL_NAME.findall(header)
    return (THINKING if channels and channels[-1] == "analysis" else ANSWER), ""


def _end_start(text: str) -> int:
    """The length of the longest end of `text` that begins an end marker."""
    longest = max(map(len, ENDS)) - 1
    return next((n for n in range(min(len(text), longest), 0, -1) if any(e.startswith(text[-n:]) for e in ENDS)), 0)


class HarmonySplitter:
    """ThinkingSplitter's interface (engine/thinking.py) for a harmony reply: push() takes the next text and gives
    (new thinking, new answer), a blank line between two messages of a part; finish() the rest at the end. `state`
    is "thinking" while an analysis message streams; `thinks` once the reply has given thinking. Messages to tools
    are nobody's text here."""

    def __init__(self) -> None:
        self.reader = Reader()
        self.given = {THINKING: False, ANSWER: False}  # a part has given text
        self.state = "start"
        self.thinks = False

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        out = {THINKING: "", ANSWER: ""}
        for m, new in self.reader.push(delta, final):
            if new and m.kind in out:
                out[m.kind] += ("\n\n" if self.given[m.kind] and m.body == new else "") + new
                self.given[m.kind] = True
        last = self.reader.messages[-1] if self.reader.messages else None
        self.state = "thinking" if last is not None and last.kind == THINKING and not last.whole else "answer"
        self.thinks = self.given[THINKING]
        return out[THINKING], out[ANSWER]

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)


# ---- the conversation as gpt-oss's template takes it ----


def for_template(messages: list[dict]) -> list[dict]:
    """The messages as gpt-oss's template reads them. An earlier reply's thinking goes in its `thinking` field: the
    template drops it but for the calls of the turn in progress, where the model needs it; it comes from the reply's
    content as llamaterm gives replies back (harmony's own markup, as the engine streams it and the TUI keeps it;
    a <think> block, as `serve` sends it) or from vLLM's `reasoning_content`. The template refuses a message with
    calls that has both content and thinking: they are joined as its thinking. It renders one call a message and
    names each tool's reply after the last call: a message with several calls becomes one a call, each followed by
    its own reply."""
    from llamaterm.engine.thinking import split_reply  # noqa: PLC0415 (thinking.py reads harmony's replies: a cycle)

    out = []
    for m in messages:
        if m.get("role") != "assistant":
            out.append(m)
            continue
        thinking, content = split_reply(m.get("content") or "")
        thinking = m.get("thinking") or m.get("reasoning_content") or thinking
        shaped = {k: v for k, v in m.items() if k != "reasoning_content"} | {"content": content}
        if m.get("tool_calls") and content and thinking:
            thinking, shaped["content"] = thinking + "\n\n" + content, ""
        out.append(shaped | ({"thinking": thinking} if thinking else {}))
    return _one_call_each(out)


def _one_call_each(messages: list[dict]) -> list[dict]:
    out, i = [], 0
    while i < len(messages):
        m, j = messages[i], i + 1
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        replies = messages[i + 1 : j]
        for k, call in enumerate(calls):
            out.append((m if k == 0 else {"role": "assistant", "content": ""}) | {"tool_calls": [call]})
            out += [r for r in replies if r.get("tool_call_id") == call.get("id")]
        ids = {c.get("id") for c in calls}
        out += [r for r in replies if r.get("tool_call_id") not in ids]
        i = j
    return out


# ---- forced calls ----


def call_grammar(calls: list[tuple[str, dict]], marker: Callable[[str], str]) -> str:
    """A Lark grammar (llguidance's) of a reply that calls one of `calls` (a function's name, its arguments' JSON
    schema), in the form the spec gives: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` and the
    arguments, which the reply's end (<|call|>, a stop token) follows. The model may think first (analysis messages)
    and write preambles (commentary messages), as llama.cpp's grammar lets it; one call, since <|call|> ends the
    reply. marker: how the grammar writes a special token (by its id where it is one)."""
    channel, message = marker(CHANNEL), marker(MESSAGE)
    rules = [
        "start: other* call",
        f'other: {channel} ("analysis" | "commentary") {message} /(?s:.*)/ {marker(END)} {marker(START)} "assistant"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(calls))),
    ]
    for i, (name, schema) in enumerate(calls):
        header = json.dumps(f"commentary to={FUNCTIONS}{name} ")
        arguments = json.dumps(schema, ensure_ascii=False)
        rules.append(f'call_{i}: {channel} {header} {marker(CONSTRAIN)} "json" {message} %json{arguments}')
    return "\n".join(rules) + "\n"
