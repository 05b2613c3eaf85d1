"""Checked by mypy (tests/engine/test_api_contract.py), never run: every engine and backend meets
engine.api.EngineClient."""

from llamaterm.app.remote import RemoteEngine, RemoteStream
from llamaterm.engine.api import EngineClient, RequestStream
from llamaterm.engine.serving.engine import Engine, RequestHandle
from llamaterm.engine.serving.process import EngineProcess, ProcessHandle
from tests.support.fake_engine import FakeEngine, FakeHandle


def clients(local: Engine, child: EngineProcess, fake: FakeEngine, remote: RemoteEngine) -> list[EngineClient]:
    return [local, child, fake, remote]


def streams(local: RequestHandle, child: ProcessHandle, fake: FakeHandle, remote: RemoteStream) -> list[RequestStream]:
    return [local, child, fake, remote]
