"""The server on the fake engine in a process of its own, announced (app/announcements.py) as holding the model file
given, so that a test can kill it while `llamaterm run` reads its answer:

    python -m tests.support.fake_server MODEL_PATH PORT

Its replies are 2,000 words at 50 a second."""

import sys
from pathlib import Path

from llamaterm.app.announcements import Announcer, ServedModel
from llamaterm.app.server.handlers import Service
from llamaterm.app.server.http_server import serve
from llamaterm.app.server.supervisor import EngineSupervisor
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import NeverExits

LONG_REPLY = "word " * 2000


def main() -> None:
    path, port = Path(sys.argv[1]).resolve(), int(sys.argv[2])
    engine = FakeEngine(LONG_REPLY, tokens_per_s=50)
    announcer = Announcer("127.0.0.1", port, engine.device, [ServedModel(engine.model_name, str(path), None, None)])
    serve(Service(EngineSupervisor(lambda: NeverExits(engine))), "127.0.0.1", port, None, 1, announcer)


if __name__ == "__main__":
    main()
