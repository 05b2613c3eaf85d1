"""RemoteEngine on the edges a real server shows rarely: a connection dropped mid-reply, a cancel that must reach
the server, and the URLs users type."""

import socket
import threading
import time

import pytest
from fake_engine import FakeEngine
from serve_support import app_server

from llamaterm.app.remote import RemoteEngine, api_base
from llamaterm.engine.errors import LlamatermError

MODELS = b'{"object": "list", "data": [{"id": "dropper", "object": "model"}]}'


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
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        time.sleep(0.2)
                    else:
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d"
                                     b"\r\nconnection: close\r\n\r\n%s" % (len(body), body))

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


@pytest.mark.parametrize("url", ["ftp://host/v1", "http://", "not a url at all"])
def test_urls_that_are_not_servers(url):
    with pytest.raises(LlamatermError, match="not a server URL"):
        api_base(url)
