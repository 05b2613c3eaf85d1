"""Checked by mypy (tests/engine/test_api_contract.py), never run: every engine and backend meets
engine.api.EngineClient."""

from llamaterm.app.remote import RemoteEngine, RemoteStream
from llamaterm.engine.api import EngineClient, RequestStream
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.output_processor import RequestState
from llamaterm.engine.serving.process import EngineProcess
from tests.support.fake_engine import FakeEngine, FakeHandle


def clients(local: Engine, child: EngineProcess, fake: FakeEngine, remote: RemoteEngine) -> list[EngineClient]:
    return [local, child, fake, remote]


def streams(local: RequestState, fake: FakeHandle, remote: RemoteStream) -> list[RequestStream]:
    return [local, fake, remote]
