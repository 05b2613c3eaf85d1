"""A reply's token log-probabilities as the CLI and the TUI show them: each token named by the engine that
sampled it, in OpenAI's chat shape for `run --json`, and as text with probabilities for the TUI's shading."""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from dataclasses import dataclass

from llamaterm.app.openai_shapes import Responder, TokenBytes, text_of
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


@dataclass(frozen=True)
class ShownToken:
    """A reply token as the TUI shows it."""

    text: str  # what it adds to the reply's text: "" for the first bytes of a character, which a later one ends
    probability: float
    alternatives: tuple[tuple[str, float], ...]  # (token as OpenAI names it, probability), most probable first


class TokenReader:
    """A reply's TokenLogprobs, in order, into ShownTokens: the tokens' bytes decoded as one UTF-8 text, so that
    the tokens' texts join into the reply's."""

    def __init__(self, engine: EngineClient):
        self.piece = token_pieces(engine)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: TokenLogprob) -> ShownToken:
        alternatives = tuple((text_of(self.piece(t)), math.exp(lp)) for t, lp in token.top)
        return ShownToken(self.decoder.decode(self.piece(token.token_id)), math.exp(token.logprob), alternatives)
