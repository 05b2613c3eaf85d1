"""What reaches a terminal from text llamaterm did not write (app/terminal.py): escape sequences that act (window
title, clear screen, clipboard writes, cursor moves) are dropped, colour is kept, and pipes get every byte. The
end-to-end cases run `llamaterm run --server` on a pseudo-terminal against a server whose model replies with such
sequences."""

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from llamaterm.app.terminal import TerminalStream, for_terminal
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import app_server

LLAMATERM = str(Path(sys.executable).parent / "llamaterm")
ESC = "\x1b"
HOSTILE = [
    f"{ESC}]0;owned{ESC}\\",  # window title (OSC, ST)
    f"{ESC}]0;owned\x07",  # window title (OSC, BEL)
    f"{ESC}]52;c;ZWNobyBvd25lZA==\x07",  # clipboard write
    f"{ESC}[2J",  # clear screen
    f"{ESC}[1;1H",  # cursor home
    f"{ESC}[6n",  # a report the terminal types back as input
    f"{ESC}P+q544e{ESC}\\",  # DCS
    f"{ESC}c",  # reset
    "\x9b2J",  # C1 CSI
    "\x07",  # bell
    "\x08\x08\x08",  # backspaces over earlier text
    "\rover",  # a carriage return that overwrites the line
]


@pytest.mark.parametrize("sequence", HOSTILE)
def test_sequences_that_act_are_dropped(sequence):
    shown = for_terminal(f"a{sequence}b")
    assert ESC not in shown and "\x9b" not in shown and "\x07" not in shown and "\x08" not in shown
    assert shown.startswith("a") and shown.endswith("b") and "owned" not in shown


def test_colour_newlines_and_tabs_are_kept():
    text = f"{ESC}[1;31mred{ESC}[0m\n\tindented\r\n"
    assert for_terminal(text) == text


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_a_stream_drops_sequences_split_between_pieces(size):
    text = "".join(f"w{i}{s}" for i, s in enumerate(HOSTILE)) + f"{ESC}[32mgreen{ESC}[0m end"

    class Terminal:
        def isatty(self) -> bool:
            return True

    stream = TerminalStream(Terminal())
    out = "".join(stream.push(text[i : i + size]) for i in range(0, len(text), size)) + stream.flush()
    assert out == for_terminal(text)


def run_on_a_terminal(*args: str) -> tuple[int, str]:
    """`llamaterm ARGS` with stdout and stderr on a pseudo-terminal: its exit code and all it wrote."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen([LLAMATERM, *args], stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    out = b""
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not data:
            break
        out += data
    os.close(controller)
    return process.wait(timeout=60), out.decode(errors="replace")


REPLY = f"Hello{ESC}]0;owned\x07 there{ESC}[2J, {ESC}[1mbold{ESC}[0m{ESC}]52;c;ZWNobw==\x07!"


@pytest.mark.slow  # `llamaterm run` in a subprocess
def test_run_shows_a_reply_as_text_on_a_terminal_and_byte_for_byte_in_a_pipe():
    with FakeEngine(reply=REPLY) as engine, app_server(engine) as url:
        code, out = run_on_a_terminal("run", "--server", url, "hi")
        assert code == 0 and f"Hello there, {ESC}[1mbold{ESC}[0m!" in out, repr(out)
        assert "owned" not in out and "2J" not in out and "ZWNobw" not in out
        piped = subprocess.run([LLAMATERM, "run", "--server", url, "hi"], capture_output=True, text=True, timeout=60)
        assert piped.stdout == REPLY + "\n"


@pytest.mark.slow  # `llamaterm run` in a subprocess
def test_error_messages_quote_a_server_as_text_on_a_terminal():
    with FakeEngine(model_name=f"fake{ESC}]0;owned\x07{ESC}[2J") as engine, app_server(engine) as url:
        code, out = run_on_a_terminal("run", "--server", url, "--model", "other", "hi")
    assert code == 1 and "it serves fake" in out and "owned" not in out and "2J" not in out, repr(out)
