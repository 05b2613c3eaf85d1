"""Where a pane's replies come from: a local model, or a model on an OpenAI-compatible server.

A pane names its backend in its settings. The app holds one engine per backend in use, so panes on the same model
share its engine (and its batches) and panes on different models each have their own: a local model's engine in a
child process, a server's model through RemoteEngine. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Loader:
    """How `llamaterm chat` opens a backend's engine: a server's model with `api_key`; a local model on `device`,
    from a `llamaterm serve` on this machine that holds it (as `run` finds one), unless `local` or `shape` (the
    EngineConfig fields of --ctx, --kv-tokens, --speculate, ...: app/engine_flags.py) say to load it here."""

    api_key: str | None = None
    device: str | None = None
    shape: dict = field(default_factory=dict)
    local: bool = False

    def __call__(self, backend: Backend, kv_share: float) -> EngineClient:
        """The engine for `backend`. A local one loaded here takes kv_share of the memory free when it loads for its
        KV pool, so that several local models fit on one device."""
        if not backend.local:
            from llamaterm.app.remote import RemoteEngine

            return RemoteEngine(backend.server, backend.model or None, self.api_key)
        if not self.local and not self.shape:
            from llamaterm.app.announcements import find_server

            found = find_server(backend.model or None, self.device, lambda skipped: None)
            if found is not None:
                return found
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess  # the engine loop never shares a GIL with the UI

        config = EngineConfig(model=backend.model or None, device=self.device, kv_share=kv_share, **self.shape)
        return EngineProcess(config)
