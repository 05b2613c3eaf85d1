"""Checked by mypy (tests/test_api_contract.py), never run: every engine and backend meets engine.api.EngineClient."""

from llamaterm.engine.api import EngineClient, RequestStream
from llamaterm.engine.serving.engine import Engine, RequestHandle
from llamaterm.engine.serving.process import EngineProcess, ProcessHandle
from tests.fake_engine import FakeEngine, FakeHandle


def clients(local: Engine, child: EngineProcess, fake: FakeEngine) -> list[EngineClient]:
    return [local, child, fake]


def streams(local: RequestHandle, child: ProcessHandle, fake: FakeHandle) -> list[RequestStream]:
    return [local, child, fake]
