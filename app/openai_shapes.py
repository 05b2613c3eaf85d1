"""The JSON shapes of OpenAI's completion API that `llamaterm serve` answers with: whole completions, streamed
chunks, their choices (one per `n`), and token log-probabilities in the chat and the text-completion forms."""

import secrets
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from llamaterm.engine.api import TokenLogprob

TokenBytes = Callable[[int], bytes]  # a token id -> the bytes it stands for (the tokenizer's token_bytes)


class Responder:
    """One response's shapes, chat or text completion. `token_bytes` names the tokens of log-probabilities;
    token_ids: each choice carries its tokens' ids (vLLM's return_token_ids)."""

    def __init__(self, model: str, chat: bool, token_bytes: TokenBytes | None = None, token_ids: bool = False):
        self.model, self.chat, self.token_bytes, self.token_ids = model, chat, token_bytes, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        calls: list[dict] | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        ids: Sequence[int] = (),
    ) -> dict:
        """A whole completion's choice; logprobs None: not asked for."""
        shown = None if logprobs is None else self.logprobs(logprobs)
        if self.chat:
            message = {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})
            choice = {"index": index, "message": message, "logprobs": shown, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": shown, "finish_reason": finish_reason}
        return choice | ({"token_ids": list(ids)} if self.token_ids else {})

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return self.envelope("chat.completion" if self.chat else "text_completion", choices, usage=usage)

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        role: bool = False,
        calls: list[dict] | None = None,
        index: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
        offset: int = 0,
        ids: Sequence[int] = (),
        **extra: object,
    ) -> dict:
        """A streamed chunk of choice `index`; `offset`: where its text starts in the choice's whole text; `ids`:
        the tokens it adds."""
        shown = None if not logprobs else self.logprobs(logprobs, offset)
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            )
            delta |= {"tool_calls": calls} if calls else {}
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": shown, "finish_reason": finish_reason}
        choice |= {"token_ids": list(ids)} if self.token_ids else {}
        return self.envelope(self.chunk_kind, [choice], **extra)

    def envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def logprobs(self, tokens: Sequence[TokenLogprob], start: int = 0) -> dict:
        """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}. Text completions: OpenAI's older form,
        parallel lists of tokens, their logprobs, their alternatives ({token: logprob}) and each token's offset in
        the text (`start`: the offset of the first, in a stream's later chunks)."""
        assert self.token_bytes is not None
        piece = self.token_bytes
        if self.chat:
            entry = lambda t, lp: {"token": text_of(piece(t)), "logprob": lp, "bytes": list(piece(t))}
            content = [
                entry(x.token_id, x.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in x.top]} for x in tokens
            ]
            return {"content": content}
        names = [text_of(piece(x.token_id)) for x in tokens]
        offsets = list(accumulate((len(n) for n in names[:-1]), initial=start))
        return {
            "tokens": names,
            "token_logprobs": [x.logprob for x in tokens],
            "top_logprobs": [{text_of(piece(t)): lp for t, lp in x.top} for x in tokens],
            "text_offset": offsets,
        }

    def text_length(self, tokens: Sequence[TokenLogprob]) -> int:
        """The characters of the tokens' texts, as a text completion's text_offset counts them."""
        assert self.token_bytes is not None
        return sum(len(text_of(self.token_bytes(x.token_id))) for x in tokens)


def text_of(piece: bytes) -> str:
    """A token's text; a piece that is part of a UTF-8 character shows its bytes, as OpenAI's "bytes:\\xe6"."""
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)
