"""The engine contract: what callers (CLI, TUI, server) give an engine and get back, whichever engine it is —
in this process, in a child process, a test's fake, or a remote server. Imports no room of the engine."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Self, TypedDict, Unpack, runtime_checkable

from llamaterm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a plain dataclass of the checkpoints' room, named here only for its type
    from llamaterm.engine.checkpoints.sampling_defaults import SamplingDefaults


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine: the choices `llamaterm` flags and the TUI make, in one place."""

    model: str | None = None  # a store name or a path; None: the default model
    device: str | None = None  # "cpu" or "cuda"; None: cuda when available
    kv_tokens: int | None = None  # KV pool size in tokens; None: from free memory
    context_length: int | None = None  # the most tokens a sequence holds (--ctx); None: the model's own
    gpu_memory: float | None = None  # the share of the GPU's memory the engine may hold (--gpu-memory); None: free
    threads: int | None = None  # the CPU kernels' and torch's threads (--threads); None: a core each
    kv_share: float = 1.0  # of that free memory, the part this engine takes for its pool and dense copies (engines
    # on one device split it)
    block_size: int = 16  # tokens per KV block
    max_batch_tokens: int | None = None  # tokens per step; None: 2048 on CUDA, 256 on the CPU
    max_running: int = 64  # sequences decoding at once
    cuda_graphs: bool = True  # replay steps from CUDA graphs
    overlap: bool | None = None  # launch the next step before reading this one's tokens; None: on CUDA
    # speculative decoding (engine/serving/speculation.py): "ngram" drafts from each sequence's own tokens, "draft"
    # from the draft model `draft` (a store name or a path; it must share the model's vocabulary), "off"
    speculate: str = "ngram"
    draft: str | None = None
    # drafts ride while a step samples at most this many rows (a row per sequence, one per draft): one session drafts
    # up to 15 tokens. A step with drafts completes before the next is scheduled, which costs a batch its overlap:
    # the proposer weighs the overlap lost (speculation.py's BATCH_OVERLAP_COST) against the drafts' chances, so a
    # batch drafts only near-certain drafts (BENCHMARKS.md)
    speculate_tokens: int = 16
    # under a grammar, the tokens it forces (a JSON key and its punctuation) are computed in the next step's chunk
    # without sampling, as SGLang's jump-forward does (model_runner.py); False samples every token
    fast_forward: bool = True


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log-softmax of its logits before penalties, bias,
    grammar, temperature and filters, as OpenAI and vLLM report it) and the likeliest alternatives asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most probable first


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as the model wrote it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a reply's index-th tool call, as OpenAI's delta.tool_calls streams it: the first piece of a call
    has its id and name, the next ones more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


def whole_calls(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """A reply's calls from their streamed pieces."""
    calls: list[ToolCall] = []
    for d in deltas:
        if d.index == len(calls):
            calls.append(ToolCall(d.id or "", d.name or "", d.arguments))
        else:
            call = calls[d.index]
            calls[d.index] = ToolCall(call.id, call.name, call.arguments + d.arguments)
    return calls


@dataclass(frozen=True)
class Event:
    """One step of a request's stream. `text` is a UTF-8-safe delta of the reply as the model wrote it; the reply
    reader (engine/reply_reader.py) gives its reading in the other text fields, each a delta too. The last event
    has finished=True."""

    request_id: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    # when the request asked (SamplingParams.logprobs): one per token of token_ids that is part of the reply (a stop
    # token is not)
    logprobs: tuple[TokenLogprob, ...] = ()
    thinking: str = ""  # the model's thinking (<think>...</think>, harmony's analysis channel)
    answer: str = ""  # the reply less its thinking and its tool calls
    content: str = ""  # OpenAI's message content: the reply less its tool calls, harmony's thinking as <think>
    tool_calls: tuple[ToolCallDelta, ...] = ()  # where the request reads calls (SubmitOptions.tool_calls)


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    generated_tokens: int = 0
    ttft_s: float | None = None
    tokens_per_s: float = 0.0  # decode rate over a sliding window
    elapsed_s: float = 0.0
    context_tokens: int = 0  # prompt + generated so far
    max_context: int = 0
    finished: bool = False


@dataclass(frozen=True)
class EngineStats:
    model: str = ""
    device: str = ""
    running: int = 0
    waiting: int = 0
    batch_size: int = 0  # sequences in the last step
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_s: float = 0.0  # aggregate decode rate over a sliding window


def decode_rate(token_times: Sequence[float]) -> float:
    """Tokens per second over the arrival times of a request's last tokens (RequestStats.tokens_per_s)."""
    if len(token_times) < 2 or token_times[-1] <= token_times[0]:
        return 0.0
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


class EventStream:
    """A request's events as they arrive, from `events_queue` (an unbounded queue the engine side fills)."""

    events_queue: queue.SimpleQueue

    def poll(self) -> list[Event]:
        """Every event queued since the last call, without blocking. (Callers poll often, mostly finding nothing:
        empty() is cheaper than a raised queue.Empty, and with one consumer what it says holds until the get.)"""
        out = []
        while not self.events_queue.empty():
            out.append(self.events_queue.get_nowait())
        return out

    def events(self) -> Iterator[Event]:
        """Blocks until each event arrives; ends after the finishing event."""
        while True:
            event = self.events_queue.get()
            yield event
            if event.finished:
                return


class ArrivalStats:
    """stats() of a request measured where its tokens arrive (the engine process's parent, a remote server's
    client), from the attributes its stream keeps up to date."""

    prompt_tokens: int
    cached_tokens: int
    generated: int
    start: float
    first_token: float | None
    end: float | None
    token_times: Sequence[float]
    max_context: int

    def stats(self) -> RequestStats:
        return RequestStats(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            generated_tokens=self.generated,
            ttft_s=None if self.first_token is None else self.first_token - self.start,
            tokens_per_s=decode_rate(list(self.token_times)),
            elapsed_s=(self.end or time.perf_counter()) - self.start,
            context_tokens=self.prompt_tokens + self.generated,
            max_context=self.max_context,
            finished=self.end is not None,
        )


@runtime_checkable
class RequestStream(Protocol):
    """The caller's side of one request."""

    id: int

    def poll(self) -> list[Event]: ...

    def events(self) -> Iterator[Event]: ...

    def stats(self) -> RequestStats: ...


class SubmitOptions(TypedDict, total=False):
    """How submit reads its prompt, one definition for every engine; an option left out takes its default."""

    raw: bool  # the prompt is the model's input, no chat template (default: False)
    parse_special: bool  # a raw prompt's special-token text ('<|im_start|>') becomes those tokens (default: True)
    enable_thinking: bool | None  # the chat template's thinking switch (default None: the template's own)
    prompt_ids: list[int] | None  # token ids as they are, in place of the prompt (an engine of this machine's)
    tools: list[dict] | None  # what the chat template renders of the request's tools (engine/tool_calls.py)
    # the request offered tools: its reply is read for calls in this family's syntax (engine/tool_calls.py HERMES,
    # LLAMA3, MISTRAL, HARMONY) into Event.tool_calls (default None: the reply is text)
    tool_calls: str | None


@runtime_checkable
class EngineClient(Protocol):
    """What every engine offers its callers. submit and cancel return at once from any thread; events arrive on
    the returned stream; a request the engine refuses raises RequestError in submit (a remote server's refusal,
    which submit does not wait for, arrives as the stream's error event).

    sampling_defaults: the model's recommended sampling values, which user-facing commands apply to what the user
    left unset (SamplingDefaults.params); a remote engine's are the server's, unknown here."""

    model_name: str
    device: str
    max_context: int
    sampling_defaults: SamplingDefaults

    def submit(
        self, prompt: list[dict] | str | None, params: SamplingParams | None = None, **options: Unpack[SubmitOptions]
    ) -> RequestStream:
        """prompt: chat messages, or a string (a user message, or with raw the model's input)."""
        ...

    def cancel(self, handle: RequestStream | int) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc) -> None: ...
