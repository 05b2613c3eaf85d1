"""A raw HTTP server that answers as scripted, for a client's edge cases (a server that never answers, a reply that
never ends), and a guard that fails a call that hangs."""

import socket
import threading

MODELS = b'{"object": "list", "data": [{"id": "dropper", "object": "model"}]}'


def scripted_server(models: bytes, chunks: list[bytes] = (), answer: bool = True) -> int:
    """A server on a free port that answers GET /v1/models with `models` and a completion with `chunks` as
    server-sent events, one connection each; with answer=False it takes connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve() -> None:
        with listener:
            while True:
                conn, _ = listener.accept()
                request = conn.recv(65536)
                if not answer:
                    held.append(conn)  # open, unanswered
                    continue
                with conn:
                    if b"/models" in request.split(b"\r\n")[0]:
                        head = b"content-type: application/json\r\ncontent-length: %d" % len(models)
                        conn.sendall(b"HTTP/1.1 200 OK\r\n%s\r\nconnection: close\r\n\r\n%s" % (head, models))
                    else:
                        body = b"".join(b"data: %s\n\n" % c for c in chunks) + b"data: [DONE]\n\n"
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
                        )

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def within(seconds: float, work):
    """work() in a thread, or a failure after `seconds` (the old code hung for ever on these servers)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"still waiting after {seconds} s"
    return result[0]
