"""`llamaterm chat --plain` as ollama's REPL is used: a line that starts with / is a command and never reaches the
model, three quotes open and close a prompt of several lines. The chat runs as a user runs it, through --server to
the fake engine, whose requests say what the model was sent."""

import pytest

from tests.support.cli import llamaterm
from tests.support.fake_engine import REPLY, FakeEngine
from tests.support.serve_support import app_server

pytestmark = pytest.mark.slow  # `llamaterm` in a subprocess

SESSION = '''\
/help
/set temperature 0.3
/set system Be brief.
Hello
/show
"""
Fix this:
    x = 1 +
"""
/set temperature hot
/set colour blue
/nonsense
/clear
After clearing
/bye
never sent
'''


def test_commands_are_commands_and_prompts_may_have_several_lines():
    engine = FakeEngine()
    with engine, app_server(engine) as url:
        out = llamaterm("chat", "--plain", "--server", url, stdin=SESSION)
    assert out.returncode == 0, out.stderr
    sent = [(messages, params.temperature) for messages, params in engine.submitted]
    system = {"role": "system", "content": "Be brief."}
    assert sent == [
        ([system, {"role": "user", "content": "Hello"}], 0.3),
        (
            [
                system,
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": REPLY},
                {"role": "user", "content": "Fix this:\n    x = 1 +"},
            ],
            0.3,
        ),
        ([system, {"role": "user", "content": "After clearing"}], 0.3),  # /clear forgot the turns, not the settings
    ]
    err = out.stderr
    assert "/help, /?" in err and "/bye, /exit, /quit" in err and "/set NAME VALUE" in err
    assert "Set temperature to 0.3." in err and "Set the system prompt." in err
    assert "system prompt: 'Be brief.'" in err and "  temperature         0.3" in err  # /show
    assert "llamaterm: /set temperature: could not convert string to float: 'hot'" in err
    assert "llamaterm: /set takes system or one of temperature, top_k, top_p" in err
    assert "llamaterm: unknown command /nonsense: /help lists the commands (a prompt cannot start with /)" in err
    assert "Cleared the conversation." in err
    assert out.stdout.count(REPLY) == 3  # the replies, and nothing of the commands


def test_a_value_out_of_range_is_refused_and_the_chat_goes_on():
    engine = FakeEngine()
    with engine, app_server(engine) as url:
        out = llamaterm("chat", "--plain", "--server", url, stdin="/set top_p 1.5\nHi\n/set top_p\nHi again\n")
    assert out.returncode == 0, out.stderr
    assert "llamaterm: /set top_p: invalid sampling value: top_p must be in (0, 1]" in out.stderr
    assert "top_p is the model's default again." in out.stderr
    assert [params.top_p for _, params in engine.submitted] == [0.95, 0.95]  # the server's default both times
