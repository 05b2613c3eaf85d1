"""Models with random weights in real models' shapes (engine/serving/synthetic_model.py makes them), by name:
`synthetic:NAME`. What the engine process's parent needs of them, without torch: the name's test and the
tokenizer."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llamaterm.engine.checkpoints.chat_template import ChatTemplate

SYNTHETIC_PREFIX = "synthetic:"


def is_synthetic(model: str | None) -> bool:
    return model is not None and model.startswith(SYNTHETIC_PREFIX)


class SyntheticTokenizer:
    """The tokenizer of a model with random weights: prompts encode with the default model's tokenizer (its ids
    lie inside every synthetic vocabulary but the tiny one's), and replies, whatever the random weights pick, read
    as their token ids (" #123"). No stop tokens: token counts are what the benchmark asks for. Given the model's
    vocabulary, ids past it wrap into it (the tiny shapes have 512 tokens)."""

    stop_ids: frozenset[int] = frozenset()

    def __init__(self, vocab: int | None = None):
        self.vocab = vocab
        self._loaded = None
        self._lock = threading.Lock()

    @property
    def _text(self):
        """Read at the first text prompt (token-id prompts need no model file), once: a server's first requests
        arrive together, on threads of their own (functools.cached_property does not lock from Python 3.12: each
        thread would read the file, and the first tokens come late)."""
        with self._lock:
            if self._loaded is None:
                from llamaterm.engine.store.loader import load_tokenizer

                self._loaded = load_tokenizer(None)
            return self._loaded

    def encode(self, text: str, **kwargs) -> list[int]:
        return self._fold(self._text.encode(text, **kwargs))

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self._fold(self._text.encode_chat(messages, **kwargs))

    @property
    def chat_template(self) -> ChatTemplate:
        """The default model's, which renders chat prompts here (and says how their replies read)."""
        return self._text.chat_template

    def _fold(self, ids: list[int]) -> list[int]:
        return ids if self.vocab is None else [i % self.vocab for i in ids]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return "".join(f" #{i}" for i in ids)

    def detokenizer(self) -> SyntheticTokenizer:
        return self

    # A grammar (engine/serving/grammar.py) matches over the default model's pieces, so a benchmark can constrain
    # its replies; the ids past them match nothing.
    @property
    def vocab_size(self) -> int:
        return self._text.vocab_size

    @property
    def eos_id(self) -> int | None:
        return self._text.eos_id

    @property
    def bos_id(self) -> int | None:
        return self._text.bos_id

    def token_bytes(self, token_id: int) -> bytes:
        return self._text.token_bytes(token_id)

    def is_special(self, token_id: int) -> bool:
        return self._text.is_special(token_id)

    def spec(self) -> str:
        return self._text.spec()

    def push(self, token: int) -> str:
        return f" #{token}"

    def flush(self) -> str:
        return ""
