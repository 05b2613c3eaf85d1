"""A reply's text as its tokens arrive: incremental detokenization (UTF-8 safe), and stop strings held back until
they can no longer begin in the text not yet emitted. Runs in the output processor (output_processor.py)."""

from llamaterm.engine.checkpoints.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns sampled tokens into text deltas: incremental detokenization, stop strings held back until safe."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], prefix: str = ""):
        self.detok = tokenizer.detokenizer()
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = prefix
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text safe to emit now, hit a stop string). A stop string can only end in the held-back
        tail, so the search starts at the first unemitted character; the text ends where the first stop string in
        it begins (a token may hold two: `."` with stop strings `"` and `.`)."""
        self.text += self.detok.push(token_id)
        found = [i for s in self.stop if (i := self.text.find(s, self.emitted)) >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self.hold), False

    def finish(self) -> str:
        """The rest of the text: bytes the detokenizer held and the stop-string look-ahead."""
        if not self.stopped:
            self.text += self.detok.flush()
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta
