"""`llamaterm chat --plain`: a line chat for pipes and dumb terminals, as ollama's REPL is. A line is a prompt; one that
starts with / is a command, never sent to the model (/help lists them); a line of three quotes (\"\"\") opens a prompt
of several lines, and another closes it. On a terminal, readline gives the lines editing and ↑/↓ recall."""

from __future__ import annotations

import io
import sys

from llamaterm.app.console import say
from llamaterm.app.presets import SAMPLING_TYPES
from llamaterm.app.replies import collect, report
from llamaterm.engine.api import EngineClient
from llamaterm.engine.errors import RequestError

MULTILINE = '"""'
HELP = """Commands:
  /help, /?                 this list
  /show                     the model, the system prompt and the sampling values set
  /set system TEXT          a new system prompt (the conversation goes on under it)
  /set NAME VALUE           a sampling value: {names}; /set NAME alone goes back to the default
  /clear, /reset            forget the conversation
  /bye, /exit, /quit        quit (Ctrl-D too)
A line of \"\"\" starts a prompt of several lines; another \"\"\" sends it."""
QUIT = ("/bye", "/exit", "/quit")


class LineChat:
    """One conversation with `engine`, its system prompt and the sampling values the user gave (None: the model's)."""

    def __init__(self, engine: EngineClient, system: str | None, given: dict, max_tokens: int):
        self.engine, self.system, self.given, self.max_tokens = engine, system, given, max_tokens
        self.messages: list[dict] = []

    def run(self) -> None:
        say(f"llamaterm chat: {self.engine.model_name} on {self.engine.device}. /help lists the commands, /bye quits.")
        if isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8 is refused, as in a C.UTF-8 locale,
            sys.stdin.reconfigure(errors="surrogateescape")  # not a traceback where the locale decodes strictly
        if sys.stdin.isatty():
            import readline  # noqa: F401  (input() then edits lines and recalls them with ↑/↓)
        while (prompt := self.next_prompt()) is not None:
            if not prompt.strip():
                continue
            system = [{"role": "system", "content": self.system}] if self.system else []
            asked = [*system, *self.messages, {"role": "user", "content": prompt}]
            try:
                handle = self.engine.submit(asked, self.engine.sampling_defaults.params(self.given))
            except RequestError as e:
                say(f"llamaterm: {e}")
                continue
            reply = collect(handle, echo=True, fatal=False)
            if reply.finish_reason == "error":
                continue
            self.messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply.text}]
            report(handle)

    def next_prompt(self) -> str | None:
        """The next prompt, after any commands before it; None to quit."""
        while (line := read_line("> ")) is not None:
            if line.strip() == MULTILINE:
                return self.lines()
            if not line.startswith("/"):
                return line
            command = line.strip()
            if command.split()[0] in QUIT:
                return None
            self.command(command)
        return None

    def lines(self) -> str | None:
        """The lines up to the closing \"\"\" (None: the input ended first)."""
        lines: list[str] = []
        while (line := read_line(". ")) is not None:
            if line.strip() == MULTILINE:
                return "\n".join(lines)
            lines.append(line)
        return None

    def command(self, command: str) -> None:
        name, _, rest = command.partition(" ")
        if name in ("/help", "/?"):
            say(HELP.format(names=", ".join(SAMPLING_TYPES)))
        elif name in ("/clear", "/reset"):
            self.messages = []
            say("Cleared the conversation.")
        elif name == "/show":
            self.show()
        elif name == "/set":
            self.set(rest.strip())
        else:
            say(f"llamaterm: unknown command {name}: /help lists the commands (a prompt cannot start with /)")

    def set(self, rest: str) -> None:
        """/set system TEXT, /set NAME VALUE (ollama's /set parameter NAME VALUE too), /set NAME."""
        name, _, value = rest.removeprefix("parameter ").partition(" ")
        if name == "system":
            self.system = value.strip() or None
            say("Set the system prompt." if self.system else "Removed the system prompt.")
            return
        if name not in SAMPLING_TYPES:
            say(f"llamaterm: /set takes system or one of {', '.join(SAMPLING_TYPES)}, not {name or 'nothing'!r}")
            return
        try:
            new = SAMPLING_TYPES[name](value) if value.strip() else None
            given = self.given | {name: new if new is not None or name != "max_tokens" else self.max_tokens}
            self.engine.sampling_defaults.params(given)
        except (ValueError, RequestError) as e:
            say(f"llamaterm: /set {name}: {e}")
            return
        self.given = given
        say(f"Set {name} to {new}." if new is not None else f"{name} is the model's default again.")

    def show(self) -> None:
        say(f"model: {self.engine.model_name} on {self.engine.device}")
        say(f"system prompt: {self.system!r}" if self.system else "system prompt: none")
        resolved = self.engine.sampling_defaults.resolve(self.given)
        for name in SAMPLING_TYPES:
            value = self.given.get(name) if name not in resolved else resolved[name].value
            say(f"  {name:<20}{'default' if value is None else value}")


def read_line(prompt: str) -> str | None:
    """A line of input; None once it ends (Ctrl-D, or the pipe's end)."""
    try:
        return input(prompt)
    except EOFError:
        return None
