"""Logprobs through a server: RemoteEngine asks for them as OpenAI's API does and turns the reply's logprobs (in
OpenAI's documented shapes) back into Event.logprobs, each token named by the bytes the server gave."""

import json
import math

import pytest

from llamaterm.app.logprobs import logprobs_json, token_pieces
from llamaterm.app.remote import RemoteEngine, request_body
from llamaterm.engine.sampling_params import SamplingParams
from tests.support.fake_engine import FakeEngine
from tests.support.scripted_server import MODELS, scripted_server, within
from tests.support.serve_support import app_server

# OpenAI's API reference, "The chat completion chunk object" with logprobs, and a token that is part of a
# character (its bytes alone: "bytes:\xe6" in OpenAI's naming)
CHAT_CHUNKS = [
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "Hello"},
                "logprobs": {
                    "content": [
                        {
                            "token": "Hello",
                            "logprob": -0.31725305,
                            "bytes": [72, 101, 108, 108, 111],
                            "top_logprobs": [
                                {"token": "Hello", "logprob": -0.31725305, "bytes": [72, 101, 108, 108, 111]},
                                {"token": "Hi", "logprob": -1.3190403, "bytes": [72, 105]},
                            ],
                        }
                    ]
                },
                "finish_reason": None,
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"content": ""},
                "logprobs": {
                    "content": [{"token": "bytes:\\xe6", "logprob": -2.5, "bytes": [230], "top_logprobs": []}]
                },
                "finish_reason": "length",
            }
        ]
    },
]
# OpenAI's older form, of /v1/completions
TEXT_CHUNK = {
    "choices": [
        {
            "index": 0,
            "text": " Paris",
            "logprobs": {
                "tokens": [" Paris"],
                "token_logprobs": [-0.05],
                "top_logprobs": [{" Lyon": -4.0, " Paris": -0.05}],
                "text_offset": [0],
            },
            "finish_reason": "stop",
        }
    ]
}


def events_of(chunks: list[dict], raw: bool = False) -> tuple[list, RemoteEngine]:
    port = scripted_server(MODELS, [json.dumps(c).encode() for c in chunks])
    engine = RemoteEngine(f"http://127.0.0.1:{port}")
    return within(10, lambda: list(engine.submit("hi", SamplingParams(logprobs=2), raw=raw).events())), engine


def named(engine, events) -> list[tuple[bytes, float, list[tuple[bytes, float]]]]:
    """Each token's bytes and logprob, and its alternatives'."""
    piece = token_pieces(engine)
    return [(piece(lp.token_id), lp.logprob, [(piece(t), v) for t, v in lp.top]) for e in events for lp in e.logprobs]


def test_a_chat_reply_s_logprobs_become_events_logprobs():
    events, engine = events_of(CHAT_CHUNKS)
    with engine:
        assert named(engine, events) == [
            (b"Hello", -0.31725305, [(b"Hello", -0.31725305), (b"Hi", -1.3190403)]),
            (b"\xe6", -2.5, []),
        ]
        assert events[-1].finish_reason == "length"
        # and back out in OpenAI's shape, as `run --json` prints them
        shown = logprobs_json(engine, [lp for e in events for lp in e.logprobs])
        assert shown["content"][0] == CHAT_CHUNKS[0]["choices"][0]["logprobs"]["content"][0]
        assert shown["content"][1]["token"] == "bytes:\\xe6" and shown["content"][1]["bytes"] == [230]


def test_a_text_completion_s_logprobs_become_events_logprobs_most_probable_first():
    events, engine = events_of([TEXT_CHUNK], raw=True)
    with engine:
        assert named(engine, events) == [(b" Paris", -0.05, [(b" Paris", -0.05), (b" Lyon", -4.0)])]


@pytest.mark.parametrize(
    "logprobs",
    [
        {"content": [{"token": "a", "logprob": "low"}]},
        {"content": [{"token": "a", "logprob": -1, "bytes": [300]}]},
        {"content": [{"token": 5, "logprob": -1}]},
        {"tokens": ["a", "b"], "token_logprobs": [-1]},
        {"tokens": ["a"], "token_logprobs": [-1], "top_logprobs": [{"b": "x", "c": -1}]},
        [1, 2],
    ],
)
def test_logprobs_not_in_openai_s_shape_fail_that_request_only(logprobs):
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": logprobs}]}
    events, engine = events_of([chunk])
    with engine:
        assert events[-1].finish_reason == "error" and "not OpenAI-compatible" in events[-1].error


def test_logprobs_are_asked_for_as_openai_s_api_names_them():
    _, chat = request_body("m", "hi", SamplingParams(logprobs=3), raw=False)
    _, text = request_body("m", "hi", SamplingParams(logprobs=3), raw=True)
    _, neither = request_body("m", "hi", SamplingParams(), raw=False)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 3)
    assert text["logprobs"] == 3 and "top_logprobs" not in text
    assert "logprobs" not in neither and "top_logprobs" not in neither


def test_logprobs_through_llamaterm_serve_name_the_engine_s_tokens():
    """RemoteEngine on `llamaterm serve` over the fake engine: the same tokens and values as the fake gives."""
    served = FakeEngine("Paris is the capital.")
    with served, app_server(served) as url, RemoteEngine(url) as engine:
        events = list(engine.submit("hi", SamplingParams(logprobs=2)).events())
        local = list(served.submit("hi", SamplingParams(logprobs=2)).events())
        assert named(engine, events) == named(served, local)
        assert [math.exp(lp.logprob) for e in events for lp in e.logprobs] == pytest.approx([0.9, 0.6, 0.3, 0.9])
