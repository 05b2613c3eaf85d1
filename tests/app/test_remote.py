"""RemoteEngine on the edges a real server shows rarely: a connection dropped mid-reply, a cancel that must reach
the server, and the URLs users type."""

import json
import socket
import threading
import time

import httpx2
import pytest

from llamaterm.app import remote
from llamaterm.app.remote import RemoteEngine, api_base
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.sampling_params import SamplingParams
from tests.support.fake_engine import REPLY, FakeEngine, words
from tests.support.scripted_server import MODELS, scripted_server, within
from tests.support.serve_support import app_server


def dropping_server() -> tuple[int, threading.Thread]:
    """Answers GET /v1/models, then a completion with one chunk, then closes the connection mid-reply."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            for body, stream in ((MODELS, False), (None, True)):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    if stream:
                        chunk = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(chunk), chunk)
                        )
                        time.sleep(0.2)
                    else:
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                            b"\r\nconnection: close\r\n\r\n%s" % (len(body), body)
                        )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_a_dropped_connection_ends_the_reply_with_an_error():
    port, thread = dropping_server()
    with RemoteEngine(f"http://127.0.0.1:{port}") as remote:
        assert remote.model_name == "dropper" and remote.max_context == 0  # this server does not say
        events = list(remote.submit("hi").events())
    thread.join(timeout=10)
    assert "".join(e.text for e in events) == "Hel"
    assert events[-1].finish_reason == "error" and "connection" in events[-1].error


def test_a_cancel_reaches_the_server_and_frees_its_request():
    served = FakeEngine(hold=True)  # would run until cancelled
    with served, app_server(served) as url, RemoteEngine(url) as remote:
        stream = remote.submit("hi")
        next(stream.events())
        assert served.stats().running == 1
        remote.cancel(stream)
        assert list(stream.events())[-1].finish_reason == "cancelled"
        deadline = time.monotonic() + 10
        while served.stats().running:  # the server saw the connection close and cancelled the request
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize(
    "url, base",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
        ("localhost:8000", "http://localhost:8000/v1"),
        ("https://gpu-box/api/v1/", "https://gpu-box/api/v1"),
    ],
)
def test_server_urls(url, base):
    assert api_base(url) == base


def test_a_server_that_never_answers_is_refused_in_time(monkeypatch):
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT_S", 0.5)
    port = scripted_server(MODELS, answer=False)

    def connect():
        with pytest.raises(LlamatermError, match="cannot reach the server") as err:
            RemoteEngine(f"http://127.0.0.1:{port}")
        return err

    within(10, connect)


@pytest.mark.parametrize(
    "chunk",
    [
        b"[1, 2]",  # not an object
        b'{"choices": "abc"}',
        b'{"choices": [{"index": 0, "delta": "abc"}]}',
        b'{"choices": [{"index": 0, "delta": {"content": 5}}]}',
        b'{"choices": [{"index": 0, "text": "a", "finish_reason": 7}]}',
        b'{"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": [1]}}',
        b'{"choices": [], "usage": 12}',
    ],
)
def test_a_reply_not_in_openai_s_shape_fails_that_request_only(chunk):
    """Each of these ended the reader thread with an exception (AttributeError, TypeError): the request never
    finished, so `llamaterm run` and the pane waited for ever, or stats() failed on a count that was text."""
    models = b'{"object": "list", "data": [{"id": "odd", "max_model_len": "a lot"}]}'
    port = scripted_server(models, [b'{"choices": [{"index": 0, "delta": {"content": "Hi"}}]}', chunk])
    with RemoteEngine(f"http://127.0.0.1:{port}") as engine:
        assert engine.max_context == 0  # "a lot" is no count
        stream = engine.submit("hi")
        events = within(10, lambda: list(stream.events()))
        assert events[-1].finish_reason == "error" and "server" in events[-1].error
        stats = stream.stats()
        assert stats.finished and stats.prompt_tokens == 0 and stats.context_tokens == stats.generated_tokens
        assert engine.submit("again") is not None  # the engine itself goes on


def test_text_that_is_not_unicode_is_refused_before_it_is_sent():
    """It failed in the reader thread while httpx encoded the body, blamed on the server's reply."""
    port = scripted_server(MODELS)
    with RemoteEngine(f"http://127.0.0.1:{port}") as engine:
        with pytest.raises(RequestError, match="not valid Unicode"):
            engine.submit([{"role": "user", "content": "caf\udce9"}])


@pytest.mark.parametrize(
    "url",
    ["ftp://host/v1", "http://", "not a url at all", "http://[::1", "http://256.1.1.1/v1", "http://127.0.0.1:99999/v1"],
)
def test_urls_that_are_not_servers(url):
    with pytest.raises(LlamatermError, match="not a server URL"):
        api_base(url)


def streaming_server(models: bytes, write) -> int:
    """A server whose completion reply is a chunked event stream that `write(send)` writes, chunk by chunk, for as
    long as it likes (send raises once the client has gone)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            while True:
                conn, _ = listener.accept()
                with conn:
                    request = conn.recv(65536)
                    if b"/models" in request.split(b"\r\n")[0]:
                        head = b"content-type: application/json\r\ncontent-length: %d" % len(models)
                        conn.sendall(b"HTTP/1.1 200 OK\r\n%s\r\nconnection: close\r\n\r\n%s" % (head, models))
                        continue
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    )
                    try:
                        write(lambda data, conn=conn: conn.sendall(b"%x\r\n%s\r\n" % (len(data), data)))
                        time.sleep(2)  # the connection stays open: what was sent is read, not reset
                    except OSError:  # the client closed the connection
                        pass

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


HELLO = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'


def endless(piece: bytes):
    def write(send) -> None:
        send(HELLO)
        while True:
            send(piece)
            time.sleep(0.01)

    return write


def forever_silent(send) -> None:
    send(HELLO)
    time.sleep(60)


@pytest.mark.parametrize(
    "write, words",
    [
        (endless(b": ping\n\n"), "no text of the reply for 1 s"),  # comments forever
        (endless(b'data: {"choices": []}\n\n'), "no text of the reply for 1 s"),  # empty chunks forever
        (endless(b'data: {"choices": [{"index": 0, "delta": {"content": ""}}]}\n\n'), "no text of the reply"),
        (forever_silent, "ReadTimeout"),  # the reply stops mid-way, the connection open
        (lambda send: send(HELLO + b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n"), "JSON nested too deeply"),
        (lambda send: [send(HELLO)] + [send(b"x" * 65536) for _ in range(40)], "a line of over 1048576 bytes"),
    ],
    ids=["pings", "empty-chunks", "empty-text", "silent", "deep-json", "long-line"],
)
def test_a_server_that_never_finishes_its_reply_ends_it_with_an_error(monkeypatch, write, words):
    """Each of these hung `llamaterm run --server` (and a pane) for ever, or killed the reader thread."""
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 1.0)
    port = streaming_server(MODELS, write)
    with RemoteEngine(f"http://127.0.0.1:{port}") as engine:
        events = within(10, lambda: list(engine.submit("hi").events()))
    assert "".join(e.text for e in events) == "Hi"
    assert events[-1].finish_reason == "error" and words in events[-1].error, events[-1].error


@pytest.mark.parametrize(
    "models",
    [b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"data": [{"id": "' + b"m" * (2 << 20) + b'"}]}'],
    ids=["deep", "huge"],
)
def test_a_models_reply_too_deep_or_too_big_is_no_server(models):
    port = scripted_server(models)

    def connect():
        with pytest.raises(LlamatermError, match="is not an OpenAI-compatible server") as err:
            RemoteEngine(f"http://127.0.0.1:{port}")
        return err

    within(10, connect)


@pytest.mark.parametrize("chat", [True, False])
def test_return_token_ids_gives_the_engine_s_ids_whole_and_streamed(chat):
    """vLLM's field on llamaterm serve; RemoteEngine(token_ids=True) reads them into its events."""
    with FakeEngine() as engine, app_server(engine) as url:
        path = "/chat/completions" if chat else "/completions"
        body = {"model": "fake-llama", "max_tokens": 4} | (
            {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        )
        ids = [engine.vocabulary.id_of(w) for w in words(REPLY)[:4]]
        whole = httpx2.post(url + path, json=body | {"return_token_ids": True}).json()["choices"][0]
        assert whole["token_ids"] == ids
        assert "token_ids" not in httpx2.post(url + path, json=body).json()["choices"][0]  # not asked for
        with httpx2.stream("POST", url + path, json=body | {"return_token_ids": True, "stream": True}) as reply:
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
        bad = httpx2.post(url + path, json=body | {"return_token_ids": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_token_ids"
        with RemoteEngine(url, token_ids=True) as remote:
            events = list(
                remote.submit(
                    "hi" if not chat else [{"role": "user", "content": "hi"}],
                    SamplingParams(max_tokens=4),
                    raw=not chat,
                ).events()
            )
        assert [t for e in events for t in e.token_ids] == ids
