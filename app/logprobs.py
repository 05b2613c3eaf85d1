"""A reply's token log-probabilities as the CLI and the TUI show them: each token named by the engine that
sampled it, in OpenAI's chat shape for `run --json`."""

from __future__ import annotations

from collections.abc import Sequence

from llamaterm.app.openai_shapes import Responder, TokenBytes
from llamaterm.engine.api import EngineClient, TokenLogprob


def token_pieces(engine: EngineClient) -> TokenBytes:
    """The bytes each token id of the engine's Event.logprobs stands for: a local model's tokenizer's, or the
    pieces a server named (RemoteEngine numbers them, as OpenAI's replies carry no ids)."""
    from llamaterm.app.remote import RemoteEngine

    if isinstance(engine, RemoteEngine):
        return engine.tokens.token_bytes
    return engine.tokenizer.token_bytes  # type: ignore[attr-defined]  # Engine's and EngineProcess's, not the protocol's


def logprobs_json(engine: EngineClient, tokens: Sequence[TokenLogprob]) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs}]}: a chat completion choice's `logprobs`, as OpenAI and
    `llamaterm serve` give it."""
    return Responder(engine.model_name, chat=True, token_bytes=token_pieces(engine)).logprobs(tokens)
