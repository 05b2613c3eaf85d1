"""Text that llamaterm did not write (a model's reply, a server's error, a model id), made safe for a terminal.

A terminal obeys the escape sequences in what it prints: a reply could set the window title, clear the screen,
move the cursor over earlier output, or write the clipboard (OSC 52). What reaches a terminal from such text keeps
printable characters, newlines, tabs, a CR before a newline, and colour and style (SGR: ESC [ ... m), which change
nothing but how the text looks; every other escape sequence and control character is dropped. Output to a pipe or
a file, and `--json`, stay byte for byte.
"""

import re
from typing import TextIO

_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: cursor moves, erasing, modes ... and SGR
    r"|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC, DCS, SOS, PM, APC strings, ended by BEL or ST
    r"|\x1b[ -/]*[0-~]"  # the other escape sequences
    r"|\r(?!\n)|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"  # other C0 controls (a lone ESC too), DEL, C1 controls
)
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
# the start of a sequence that may end in the next piece of a stream
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*\x1b?|[ -/]*)?")
MAX_HELD = 4096  # a sequence longer than this is no sequence a terminal should see: its text is printed


def shown(text: str, stream: TextIO) -> str:
    """The text as it may be written to `stream`: for_terminal on a terminal, byte for byte to a pipe or a file."""
    return for_terminal(text) if stream.isatty() else text


def for_terminal(text: str) -> str:
    """The text without the escape sequences and control characters a terminal would act on, colour kept."""
    return _SEQUENCE.sub(lambda m: m[0] if _SGR.fullmatch(m[0]) else "", text)


class TerminalStream:
    """for_terminal over a text that arrives in pieces, for `stream` if it is a terminal (else the pieces as they
    are): a sequence split between two pieces is held back until it is whole, so it is dropped whole."""

    def __init__(self, stream: TextIO) -> None:
        self.terminal = stream.isatty()
        self.held = ""

    def push(self, piece: str) -> str:
        if not self.terminal:
            return piece
        text, self.held = self.held + piece, ""
        start = text.find("\x1b", max(0, len(text) - MAX_HELD))
        while start >= 0:
            if _UNFINISHED.fullmatch(text, start):  # (an OSC's body, then the ESC of its ST, is one)
                text, self.held = text[:start], text[start:]
                break
            start = text.find("\x1b", start + 1)
        return for_terminal(text)

    def flush(self) -> str:
        """The end of the text: a sequence that never finished is dropped at its escape character."""
        text, self.held = self.held, ""
        return for_terminal(text)
