"""The front end of a local engine, in the caller's process, over an engine core in this process
(engine/serving/engine.py) or in a child process (engine/serving/process.py), as vLLM's front end is over its engine
core. A request goes in as the caller gives it and is encoded here (its template and tokenizer: prompt.py) and
checked against the model's limits, so a refusal is the caller's exception; the core gets token ids and gives
token ids back, which the output processor (output_processor.py) turns into each request's events, read as the
model's template writes replies (engine/reply_reader.py). No torch here:
the engine process's parent loads none."""

from __future__ import annotations

import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, Self, Unpack

from llamaterm.engine.api import EngineStats, RequestStream, SubmitOptions
from llamaterm.engine.checkpoints.sampling_defaults import SamplingDefaults
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import LlamatermError, RequestError
from llamaterm.engine.reply_reader import reader_for
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.grammar import vocabulary
from llamaterm.engine.serving.output_processor import OutputProcessor, RequestState, TokenOutput
from llamaterm.engine.serving.prompt import PromptEncoder, check_prompt
from llamaterm.engine.serving.step_stats import StepStats


@dataclass(frozen=True)
class CoreInfo:
    """What the front end knows of its core's model once it is loaded."""

    model_name: str
    device: str
    max_context: int
    sequence_limit: int  # the longest prompt plus reply the KV pool holds (EngineCore.sequence_limit)
    vocab_size: int
    sampling_defaults: SamplingDefaults  # the model's (engine/checkpoints/sampling_defaults.py)


class CoreClient(Protocol):
    """An engine core as its front end calls it: each call returns at once, from any thread."""

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def abort(self, request_id: int) -> None: ...

    def together(self) -> AbstractContextManager[object]: ...  # requests added inside reach the scheduler together

    def stats(self) -> EngineStats: ...

    def step_stats(self) -> StepStats: ...

    def shutdown(self) -> None: ...


class FrontEnd:
    """Satisfies engine.api.EngineClient over an engine core. The core's outputs arrive through take_outputs."""

    def __init__(self, core: CoreClient, tokenizer: Tokenizer, info: CoreInfo):
        self.model_name, self.device, self.max_context = info.model_name, info.device, info.max_context
        self.sampling_defaults, self.vocab_size = info.sampling_defaults, info.vocab_size
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer)
        self.output = OutputProcessor(tokenizer, info.max_context)
        self._core, self._info = core, info
        self._ids = itertools.count(1)

    def submit(
        self, prompt: list[dict] | str | None, params: SamplingParams | None = None, **options: Unpack[SubmitOptions]
    ) -> RequestState:
        """Queue a request (engine.api.EngineClient.submit), encoded here, in the caller's thread; one the model
        cannot take raises RequestError here."""
        params = params or SamplingParams()
        ids, opens = self.prompts.prompt_ids(prompt, options)
        info = self._info
        check_prompt(ids, info.vocab_size, info.max_context, info.sequence_limit)
        params.check_vocabulary(info.vocab_size)
        if params.grammar is not None:  # compiled here, in the caller's thread, and refused as the caller's error
            vocabulary(self.tokenizer, info.vocab_size).check(params.grammar)
        request_id = next(self._ids)
        reader = reader_for(self.tokenizer, options)
        state = self.output.add(request_id, params, len(ids), opens, reader)
        try:
            self._core.add(request_id, ids, params)
        except BaseException:
            del self.output.requests[request_id]
            raise
        return state

    def together(self) -> AbstractContextManager[object]:
        """Requests submitted inside (from this thread) reach the engine's scheduler in one step: a response's n
        choices, forked from one prefill (engine/serving/scheduler.py)."""
        return self._core.together()

    def cancel(self, handle: RequestStream | int) -> None:
        """Stop a request at once and free its blocks; a no-op for unknown or finished requests."""
        self._core.abort(handle if isinstance(handle, int) else handle.id)

    def take_outputs(self, outputs: list[TokenOutput], cached: list[tuple[int, int]]) -> None:
        """The core's outputs, on the thread they arrive on: each request's events; those a stop string ended are
        aborted in the core."""
        for request_id in self.output.process(outputs, cached):
            try:
                self._core.abort(request_id)
            except LlamatermError:  # the engine has exited: the request ended with it
                pass

    def generate(self, prompt, params: SamplingParams | None = None, **kwargs) -> tuple[str, RequestState]:
        """Blocking convenience: the whole reply text."""
        handle = self.submit(prompt, params, **kwargs)
        text = []
        for event in handle.events():
            if event.error:
                raise RequestError(event.error)
            text.append(event.text)
        return "".join(text), handle

    def encode_prompt(
        self, prompt: list[dict] | str, raw: bool = False, enable_thinking: bool | None = None
    ) -> list[int]:
        return self.prompts.encode(prompt, raw, enable_thinking)[0]

    def stats(self) -> EngineStats:
        return self._core.stats()

    def step_stats(self) -> StepStats:
        """What the engine's steps did, for `llamaterm bench` (engine/serving/step_stats.py)."""
        return self._core.step_stats()

    def shutdown(self) -> None:
        """Stop the engine; requests still in flight finish as cancelled."""
        self._core.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
