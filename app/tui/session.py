"""One conversation as a pane holds it: settings, messages, the request in flight. No widgets here.

Every message goes to the history as it happens: the user's at once, the reply when its first text arrives,
then again at most every SAVE_EVERY_S while it streams and once when it ends.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields

from llamaterm.app.history import Conversation, History
from llamaterm.app.logprobs import ShownToken, TokenReader
from llamaterm.app.tui.backends import Backend
from llamaterm.engine.api import EngineClient, RequestStats, RequestStream
from llamaterm.engine.checkpoints.sampling_defaults import FIELDS, SamplingDefaults
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import Grammar, SamplingParams
from llamaterm.engine.thinking import split_reply

SAVE_EVERY_S = 1.0
TOPIC_CHARS = 48
ALTERNATIVES = 5  # a token's alternatives a pane asks for, when it shades tokens by probability


@dataclass(frozen=True)
class ChatSettings:
    system: str = ""
    # the sampling values the user set; None: the model's default (its engine's sampling_defaults)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int = 1024
    seed: int | None = None
    model: str = ""  # see Backend: "" is the default model, or the server's first
    server: str = ""  # "" is this machine
    thinking: bool | None = None  # the chat template's thinking switch (Qwen3's enable_thinking); None: its default
    json_schema: str = ""  # a JSON Schema (its text) that replies follow; "" none
    token_probabilities: bool = False  # replies ask for logprobs, and their tokens are shaded by probability

    def __post_init__(self):
        # a bad value fails here, where the user typed it, not in the engine
        SamplingParams(**{k: v for k, v in self.sampling_given().items() if v is not None})
        if self.server:
            from llamaterm.app.remote import api_base

            api_base(self.server)
        if self.json_schema:
            from llamaterm.engine.serving import grammar  # llguidance, no torch

            grammar.check(Grammar("json_schema", self.json_schema))  # its refusals name the JSON schema

    @property
    def backend(self) -> Backend:
        return Backend(self.model, self.server)

    def sampling_given(self) -> dict:
        """What the user set of SamplingParams' fields (None: not set)."""
        given = {name: getattr(self, name) for name in (*FIELDS, "max_tokens", "seed")}
        return given | {
            "grammar": Grammar("json_schema", self.json_schema) if self.json_schema else None,
            "logprobs": ALTERNATIVES if self.token_probabilities else None,
        }

    @property
    def schema_name(self) -> str:
        """How the pane names its schema: the schema's title, else "JSON schema"; "" without one."""
        if not self.json_schema:
            return ""
        title = json.loads(self.json_schema).get("title") if self.json_schema.lstrip().startswith("{") else None
        return title if isinstance(title, str) and title.strip() else "JSON schema"

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        """The user's values, the model's `defaults` for the rest."""
        return defaults.params(self.sampling_given())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChatSettings:
        return cls(**known_fields(cls, data))


@dataclass(eq=False)
class ChatMessage:
    role: str  # "user" | "assistant"
    content: str = ""
    id: int | None = None  # row in the history, once saved
    finish_reason: str | None = None
    error: str | None = None
    # a reply whose request asked for logprobs (the pane shades tokens): its tokens as they arrive; not saved
    tokens: list[ShownToken] | None = None
    # a reply's content parted as its events part it (Event.thinking, Event.answer); saved is the content alone
    thinking: str = ""
    answer: str = ""

    @classmethod
    def saved(cls, role: str, content: str, id: int | None, finish_reason: str | None) -> ChatMessage:
        """A message from the history, a reply's content parted as the engine parts a reply's text."""
        thinking, answer = split_reply(content) if role == "assistant" else ("", content)
        return cls(role, content, id, finish_reason, thinking=thinking, answer=answer)


class Session:
    def __init__(self, history: History, settings: ChatSettings | None = None, name: str | None = None):
        self.history = history
        self.settings = settings or ChatSettings()
        self.name = name  # given by the user (or a reopened conversation); kept when the pane is cleared
        self.topic = ""  # the first prompt, the title of an unnamed conversation
        self.conversation_id: int | None = None
        self.messages: list[ChatMessage] = []
        self.handle: RequestStream | None = None  # the engine's stream while a reply streams
        self.engine: EngineClient | None = None  # the engine that took the request, to cancel it
        self.queued = False  # asked before the engine was ready; submitted once it is
        self.stats: RequestStats | None = None
        self._saved_at = 0.0
        self._tokens: TokenReader | None = None  # the reply's, while it streams with logprobs

    @classmethod
    def reopen(cls, history: History, conv: Conversation) -> Session:
        session = cls(history, ChatSettings.from_dict(conv.settings), name=conv.title)
        session.conversation_id = conv.id
        session.messages = [ChatMessage.saved(m.role, m.content, m.id, m.finish_reason) for m in conv.messages]
        if conv.messages and conv.messages[-1].stats:
            session.stats = RequestStats(**known_fields(RequestStats, conv.messages[-1].stats))
        return session

    @property
    def title(self) -> str:
        return self.name or self.topic or "New chat"

    @property
    def busy(self) -> bool:
        return self.handle is not None or self.queued

    @property
    def reply(self) -> ChatMessage | None:
        """The last assistant message."""
        return next((m for m in reversed(self.messages) if m.role == "assistant"), None)

    def last_prompt(self) -> ChatMessage | None:
        return next((m for m in reversed(self.messages) if m.role == "user"), None)

    def request_messages(self) -> list[dict]:
        """What the engine sees: the system prompt, then every message with text (not the reply being made)."""
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + [{"role": m.role, "content": m.content} for m in self.messages if m.content]

    def ask(self, text: str) -> tuple[ChatMessage, ChatMessage]:
        """Add the user's message (saved now) and an empty reply; `submit` sends them."""
        if not self.topic:
            line = " ".join(text.split())  # a prompt of several lines titles its pane on one
            self.topic = line if len(line) <= TOPIC_CHARS else line[: TOPIC_CHARS - 1] + "…"
        if self.conversation_id is None:
            self.conversation_id = self.history.create_conversation(self.title, self.settings.to_dict())
        prompt = ChatMessage("user", text)
        prompt.id = self.history.add_message(self.conversation_id, "user", text)
        reply = ChatMessage("assistant", tokens=[] if self.settings.token_probabilities else None)
        self.messages += [prompt, reply]
        self.queued, self.stats = True, None
        return prompt, reply

    def submit(self, engine: EngineClient) -> None:
        """Send the queued request. One the engine refuses (too long for the context) or cannot take (its process
        has exited) ends with its reason."""
        self.queued, self.engine = False, engine
        self._tokens = TokenReader(engine) if self.messages[-1].tokens is not None else None
        try:
            self.handle = engine.submit(
                self.request_messages(),
                self.settings.sampling_params(engine.sampling_defaults),
                enable_thinking=self.settings.thinking,
            )
        except LlamatermError as e:
            self._end_reply("error", str(e))

    def poll(self) -> tuple[str, bool]:
        """Drain the engine's events (never blocks): (new text, whether the reply ended). Only while a reply
        streams (handle set)."""
        handle = self.handle
        assert handle is not None  # the screen polls only the sessions with a request in flight
        events = handle.poll()
        if not events:
            return "", False
        text = "".join(e.text for e in events)
        reply = self.messages[-1]
        reply.content += text
        reply.thinking += "".join(e.thinking for e in events)
        reply.answer += "".join(e.answer for e in events)
        if self._tokens is not None and reply.tokens is not None:
            reply.tokens += [self._tokens(t) for e in events for t in e.logprobs]
        last = events[-1]
        if last.finished:
            self.stats, self.handle = handle.stats(), None
            self._end_reply(last.finish_reason, last.error)
            return text, True
        if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
            self._save_reply()
        return text, False

    def fail(self, error: str) -> None:
        """End a queued request that cannot be sent (its model did not load)."""
        self.queued = False
        self._end_reply("error", error)

    def refresh_stats(self) -> None:
        if self.handle is not None:
            self.stats = self.handle.stats()

    def stop(self) -> None:
        """Stop the reply; the engine's "cancelled" event ends it (or at once, if it was never sent)."""
        if self.handle is not None:
            self._cancel(self.handle)
        elif self.queued:
            self.queued = False
            self._end_reply("cancelled", None)

    def rewind(self) -> str:
        """Forget the last prompt and all after it (here and in the history); returns its text to send again."""
        prompt = self.last_prompt()
        # callers rewind only a session with a prompt, which ask() saved (or the history gave back) with its id
        assert prompt is not None and prompt.id is not None and self.conversation_id is not None
        if self.handle is not None:
            self._cancel(self.handle)
        self.handle, self.queued, self.stats = None, False, None
        self.messages = self.messages[: self.messages.index(prompt)]
        self.history.delete_messages_from(self.conversation_id, prompt.id)
        return prompt.content

    def rename(self, name: str) -> None:
        """An empty name goes back to the topic as the title."""
        self.name = name or None
        if self.conversation_id is not None:
            self.history.update_conversation(self.conversation_id, title=self.title)

    def configure(self, settings: ChatSettings) -> None:
        self.settings = settings
        if self.conversation_id is not None:
            self.history.update_conversation(self.conversation_id, settings=settings.to_dict())

    def close(self) -> None:
        """The pane is closing or moving on: save what streamed so far as stopped, free the engine's work."""
        if not self.busy:
            return
        if self.handle is not None:
            self._cancel(self.handle)
        self.handle, self.queued = None, False
        self._end_reply("cancelled", None)

    def _cancel(self, handle: RequestStream) -> None:
        assert self.engine is not None  # submit() set it along with the handle
        try:
            self.engine.cancel(handle)
        except LlamatermError:  # the engine's process has exited: its requests end with that error
            pass

    def _end_reply(self, reason: str | None, error: str | None) -> None:
        reply = self.messages[-1]
        reply.finish_reason, reply.error = reason, error
        self._save_reply()

    def _save_reply(self) -> None:
        reply = self.messages[-1]
        stats = asdict(self.stats) if self.stats and reply.finish_reason else None
        if reply.id is not None:
            self.history.update_message(reply.id, reply.content, reply.finish_reason, stats)
        elif reply.content:  # an empty reply (stopped or refused before any text) is not worth a row
            assert self.conversation_id is not None  # ask() made the conversation before this reply
            reply.id = self.history.add_message(
                self.conversation_id, "assistant", reply.content, reply.finish_reason, stats
            )
        self._saved_at = time.monotonic()


def known_fields(cls, data: dict) -> dict:
    """What a dataclass takes from a dict saved in the history: keys this version does not know are dropped."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}
