"""Where a pane's replies come from: a local model, or a model on an OpenAI-compatible server.

A pane names its backend in its settings. The app holds one engine per backend in use, so panes on the same model
share its engine (and its batches) and panes on different models each have their own: a local model's engine in a
child process, a server's model through RemoteEngine. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamaterm.engine.api import EngineClient


@dataclass(frozen=True)
class Backend:
    model: str = ""  # local: a store name or a path, "" the default model; on a server: one it lists, "" its first
    server: str = ""  # an OpenAI-compatible server's URL; "" this machine

    @property
    def local(self) -> bool:
        return not self.server

    @property
    def label(self) -> str:
        if self.local:
            return self.model or "default model"
        return f"{self.model or 'first model'} @ {self.server}"


def open_engine(backend: Backend, kv_share: float, api_key: str | None, speculate: dict | None = None) -> EngineClient:
    """The engine for `backend`. A local one's KV pool takes kv_share of the memory free when it loads, so that
    several local models fit on one device; it speculates as `speculate` says (EngineConfig's fields)."""
    if backend.local:
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess  # the engine loop never shares a GIL with the UI

        return EngineProcess(EngineConfig(model=backend.model or None, kv_share=kv_share, **(speculate or {})))
    from llamaterm.app.remote import RemoteEngine

    return RemoteEngine(backend.server, backend.model or None, api_key)
