"""The engine in the caller's process: the front end (front_end.py) over an engine core (engine_core.py) whose loop
runs on a thread of its own. The core hands each step's token ids to the front end on that thread, which turns them
into the requests' events: the loop never waits on a consumer, and a consumer never blocks the loop (submit and
cancel only enqueue)."""

from __future__ import annotations

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.front_end import FrontEnd


class Engine(FrontEnd):
    """Satisfies engine.api.EngineClient with its engine core in this process."""

    def __init__(self, core: EngineCore):
        super().__init__(core, core.tokenizer, core.info())
        self.core = core
        core.start(self.take_outputs)

    @classmethod
    def from_model(cls, config: EngineConfig = EngineConfig()) -> Engine:
        """config.model (a store name or a path; None: the default model), loaded onto config.device."""
        return cls(EngineCore.from_model(config))
