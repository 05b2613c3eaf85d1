"""Grammar-constrained decoding: the engine's interface to llguidance (CPU work only; no torch at import). A grammar
compiles once; each sequence follows it with a GrammarMatcher on the model's vocabulary (raw bytes), and every step
fills the next-token bitmasks of all constrained rows in one call, the GIL released (README's How it works).
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import Grammar

if TYPE_CHECKING:  # the tokenizer's module loads numpy and more: `check` in the CLI and the server needs none of it
    from llamaterm.engine.checkpoints.tokenizer import Tokenizer

JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Grammars up to this long are cached, compiled (clients repeat their schemas): a cache of larger ones would let
# clients fill the memory with grammars (a request may carry megabytes)
CACHED_CHARS = 1 << 16
RUNS_KEPT = 4096  # forced texts a vocabulary keeps the runs of (a schema has a few dozen; enums' endings add more)
LOOKBACK_TOKENS = 4  # a forced text's last tokens whose text a longer piece may begin (llguidance's chop looks as far)
SPECIAL_MARK = b"\xff"  # llguidance's first byte of a special token's name (a byte UTF-8 never has)
# What each kind is called in a refusal
WHAT = {
    "json": "the JSON object grammar",
    "json_schema": "the JSON schema",
    "regex": "the regular expression",
    "lark": "the grammar",
}


class GrammarError(RequestError):
    """A grammar refused: a server answers it naming the request field that gave the grammar."""


def limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with errors that do not dump the parser's state and the grammar."""
    return llguidance.LLParserLimits(verbose_errors=False)


# ---- compiling, with any vocabulary ----


def check(grammar: Grammar) -> None:
    """Refuse a grammar llguidance cannot compile, with a RequestError naming the part: JSON that is not JSON, a
    schema keyword or format it does not implement, an unsatisfiable schema, a bad regular expression or Lark
    grammar. What only the vocabulary decides is Vocabulary.check's."""
    compiled(grammar)


def compiled(grammar: Grammar) -> str:
    """llguidance's grammar (its JSON form) for `grammar`, validated."""
    return _compiled_cached(grammar) if len(grammar.text) <= CACHED_CHARS else _compile(grammar)


@functools.lru_cache(maxsize=256)
def _compiled_cached(grammar: Grammar) -> str:
    return _compile(grammar)


def _compile(grammar: Grammar) -> str:
    if grammar.kind == "json":
        source = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    elif grammar.kind == "json_schema":
        source = llguidance.LLMatcher.grammar_from_json_schema(schema_text(grammar.text), defaults=JSON_LAYOUT)
    elif grammar.kind == "regex":
        source = llguidance.LLMatcher.grammar_from_regex(grammar.text)
    else:
        source = llguidance.LLMatcher.grammar_from_lark(grammar.text)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, limits=limits())
    if failed:
        raise refusal(grammar, messages[0])
    return source


def schema_text(text: str) -> str:
    """A JSON schema's text, checked to be one JSON object (or a boolean, which JSON Schema allows)."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply") from None
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if schema is False:
        raise GrammarError("the JSON schema is false, which no value matches")
    if schema is True:
        return "{}"  # any value; llguidance applies its options to objects only
    if not isinstance(schema, dict):
        raise GrammarError(f"the JSON schema must be a JSON object, not {type(schema).__name__} {text[:40]!r}")
    return text


def refusal(grammar: Grammar, message: str) -> GrammarError:
    return GrammarError(f"{WHAT[grammar.kind]} is not supported: {readable(message, grammar.kind)}")


def readable(message: str, kind: str) -> str:
    """llguidance's error on one line: without the grammar's source listed under it, the regex crate's picture of
    the pattern, or (for a regex, which llguidance wraps in a grammar of its own) a position in that wrapping."""
    message = message.replace("<non-verbose/>", "").replace(" (in regex)", "")
    message = re.sub(r"\n\s*\d+ \|.*", "", message, flags=re.S)
    message = re.sub(r"regex parse error:.*?\nerror: ", "regex parse error: ", message, flags=re.S)
    position = r"^at (\d+)\((\d+)\): "
    message = re.sub(position, "" if kind == "regex" else r"line \1, column \2: ", message)
    return " ".join(message.split())


def lark_from_ebnf(text: str) -> Grammar:
    """A grammar in llguidance's Lark syntax, or in llama.cpp's GBNF (what vLLM's and SGLang's xgrammar take),
    converted to Lark."""
    try:
        return Grammar("lark", any_to_lark(text))
    except GbnfToLarkError as e:
        raise GrammarError(f"the grammar is neither Lark nor GBNF: {' '.join(str(e).split())}") from None


def choice(options: Sequence[str]) -> Grammar:
    """A grammar that matches exactly one of the strings."""
    if not options:
        raise GrammarError("a choice needs at least one string")
    return Grammar("lark", "start: " + " | ".join(json.dumps(s) for s in options))


# ---- the model's vocabulary ----


class _Pieces:
    """A tokenizer as llguidance.TokenizerWrapper reads it."""

    def __init__(self, tokenizer: Tokenizer, size: int):
        known = min(size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(known)] + [b""] * (size - known)  # b"": no text
        self.special_token_ids = [i for i in range(known) if tokenizer.is_special(i)]
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self._encode = tokenizer.encode
        specials = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}  # each text piece's first id
        for i in reversed(range(known)):
            if i not in specials and self.tokens[i]:
                self._ids[self.tokens[i]] = i
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str | bytes) -> list[int]:
        """Ids that spell `text` exactly: the tokenizer's, where they do within the vocabulary; else the longest
        pieces first. (A benchmark's vocabulary cut from a larger tokenizer gets ids past it, folded in; a
        tokenizer may add a leading space. llguidance reads the ids as the forced text's bytes.)"""
        data = text if isinstance(text, bytes) else text.encode()
        ids = self._encode(data.decode(errors="replace"), add_special=False)
        if all(0 <= i < len(self.tokens) for i in ids) and b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._longest_first(data)

    def _longest_first(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            n = next((n for n in range(min(self._longest, len(data) - at), 0, -1) if data[at : at + n] in self._ids), 0)
            if n == 0:
                raise GrammarError(f"the model's vocabulary has no token for the byte {data[at : at + 1]!r}")
            ids.append(self._ids[data[at : at + n]])
            at += n
        return ids


def native_tokenizer(tokenizer: Tokenizer, size: int, stops: list[int]) -> llguidance.LLTokenizer | None:
    """llguidance's own build of the tokenizer (in Rust, from Tokenizer.spec), where it reads every token's bytes
    as ours and every special token of ours as special; else None. It may take more tokens as special (added tokens
    spelled <...>, as its Hugging Face reader does): grammar text never matches those.

    Why: a mask tokenizes the text the grammar forces next (`", "age": ` in a JSON object, some 35 times a step for
    64 rows). Through a Python tokenizer each of those calls waits for the GIL, which the engine's thread holds, and
    the masks took ten times as long beside a busy thread (BENCHMARKS.md, "the masks without Python")."""
    try:
        native = llguidance.LLTokenizer(tokenizer.spec(), n_vocab=size, eos_token=stops)
    except ValueError:  # a decoder or vocabulary llguidance cannot read
        return None

    def agrees(i: int) -> bool:
        piece = tokenizer.token_bytes(i)
        # llguidance reads a piece that begins with that byte (a byte-level vocabulary's token for byte 0xFF) as a
        # special token's name, through either reader
        marked = piece[:1] == SPECIAL_MARK
        special = marked or tokenizer.is_special(i)
        return native.decode_bytes([i]) == piece[marked:] and (native.is_special_token(i) or not special)

    return native if native.vocab_size == size and all(map(agrees, range(min(size, tokenizer.vocab_size)))) else None


@functools.lru_cache(maxsize=8)
def vocabulary(tokenizer: Tokenizer, size: int) -> Vocabulary:
    """The Vocabulary of a model's tokenizer and its logits' width `size`, built once (it takes seconds)."""
    return Vocabulary(tokenizer, size)


class Vocabulary:
    """llguidance's tokenizer over a model's vocabulary of `size` ids (its logits' width; ids past the tokenizer's
    match nothing), and the matchers of the grammars used on it."""

    def __init__(self, tokenizer: Tokenizer, size: int):
        # a benchmark's synthetic tokenizer stops at nothing (its token counts are forced): its EOS still ends grammars
        stops = sorted(tokenizer.stop_ids | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set()))
        if not stops:
            raise GrammarError("the model's tokenizer names no end-of-text token, which a grammar needs to end on")
        if tokenizer.eos_id in stops:  # llguidance's main EOS first
            stops.remove(tokenizer.eos_id)
            stops.insert(0, tokenizer.eos_id)
        self.size, self.words = size, (size + 31) // 32
        self._tokenizer = native_tokenizer(tokenizer, size, stops) or llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Pieces(tokenizer, size)), eos_token=stops
        )
        self._cached = functools.lru_cache(maxsize=32)(self._build)
        known = range(min(size, tokenizer.vocab_size))
        self._pieces = sorted({p for i in known if (p := tokenizer.token_bytes(i)) and not tokenizer.is_special(i)})
        self.forced_run = functools.lru_cache(maxsize=RUNS_KEPT)(self._forced_run)

    def check(self, grammar: Grammar) -> None:
        """check(grammar), and refuse one that no token of this vocabulary can begin."""
        self._start(grammar)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A new sequence's matcher (RequestError if the grammar is refused)."""
        return GrammarMatcher(self._start(grammar).deep_copy(), self.forced_run)

    def _forced_run(self, text: bytes) -> tuple[int, ...]:
        """The tokens a grammar's forced `text` is computed in without sampling: its canonical tokens, less the last
        ones that the token after could merge with (from the first of the last tokens' bytes that a longer piece of
        the vocabulary begins with: the `" ` of `", "` begins `"name`). llguidance leaves those to the sampler too,
        where the grammar allows such a piece; this asks the vocabulary alone, so the run is a function of the text:
        kept by it (a schema's `", "age": ` recurs in every record of every sequence, and finding the text costs
        less than llguidance's tokenizing it) and the same for every request, whatever came before."""
        tokens = self._tokenizer.tokenize_bytes(text)
        tail = [len(self._tokenizer.decode_bytes([t])) for t in tokens[-LOOKBACK_TOKENS:]]
        ending = text[len(text) - sum(tail) :]
        for at in range(len(ending)):
            after = bisect.bisect_right(self._pieces, ending[at:])
            if after < len(self._pieces) and self._pieces[after].startswith(ending[at:]):
                chopped, covered = 0, len(ending) - at
                while covered > 0:  # the last tokens that hold the piece's beginning
                    chopped, covered = chopped + 1, covered - tail[-1 - chopped]
                return tuple(tokens[: len(tokens) - chopped])
        return tuple(tokens)

    def _start(self, grammar: Grammar) -> llguidance.LLMatcher:
        """The grammar's matcher at its start, which sequences copy (n samples of one request, a client's repeats)."""
        return self._cached(grammar) if len(grammar.text) <= CACHED_CHARS else self._build(grammar)

    def _build(self, grammar: Grammar) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, compiled(grammar), limits=limits(), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # where no token can begin the grammar, the matcher fails here
        if "NoExtension" in matcher.get_error():
            raise GrammarError(f"{WHAT[grammar.kind]} cannot be matched: no token of the model's vocabulary begins it")
        if matcher.is_error():
            raise refusal(grammar, matcher.get_error())
        return matcher


class GrammarMatcher:
    """One sequence's place in its grammar, advanced by each token it samples. What it says after a token (done,
    or why it refused) is read out then and kept: the engine asks while the next masks fill on other threads, and
    llguidance's matcher takes one caller at a time."""

    def __init__(self, matcher: llguidance.LLMatcher, forced_run: Callable[[bytes], tuple[int, ...]]):
        self._matcher = matcher
        self._forced_run = forced_run  # a forced text's tokens (Vocabulary.forced_run)
        self._forced_text: bytes | None = None  # what forces_next found, until the matcher moves
        self.done = False  # the grammar is complete and takes nothing more but an end-of-text token
        self.refusal: str | None = None  # why the grammar refused a token, if it has

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False: the grammar refuses it, and from then on every token; error()
        says why."""
        self._forced_text = None
        if self._matcher.consume_token(token_id):  # (two calls a token: the engine makes 64 of these a step)
            self.done = self._matcher.is_stopped()
            return True
        self.done, self.refusal = False, self._matcher.get_error() or None
        return False

    def forces_next(self) -> bool:
        """The grammar forces the text that follows (fast_forward may find a run; it takes this text then)."""
        self._forced_text = self._matcher.compute_ff_bytes()
        return bool(self._forced_text)

    def fast_forward(self, most: int) -> list[int]:
        """Advance past the tokens the grammar forces next (up to `most`: in JSON a key and its punctuation, `",
        "age": `) and return them (Vocabulary.forced_run), less the last where it would end the reply (that one is
        sampled, where the reply may stop): the engine computes them in one chunk without sampling (what SGLang
        calls jump-forward)."""
        text, self._forced_text = self._forced_text, None
        if most <= 0 or self.done:
            return []
        if text is None:
            text = self._matcher.compute_ff_bytes()
        if not text:
            return []
        forced = list(self._forced_run(text)[:most])
        taken = self._matcher.try_consume_tokens(forced) if forced else 0
        if taken < len(forced):
            self._matcher.rollback(taken)
            return []
        if forced and self._matcher.is_stopped():
            self._matcher.rollback(1)
            forced.pop()
        return forced

    def is_done(self) -> bool:
        """The grammar is complete and takes nothing more but an end-of-text token: the reply ends ("stop")."""
        return self.done

    def error(self) -> RequestError | None:
        """Why the grammar refused a token, if it has."""
        return RequestError(f"the reply left its grammar: {readable(self.refusal, '')}") if self.refusal else None


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor(mask_threads())


def mask_threads() -> int:
    """llguidance's threads for the masks: two where the machine has 8 cores or more, else one. A step waits for
    its masks: a second thread fills them sooner on a large host (more gain nothing, tests/benchmarks/grammar_masks.py),
    and on two cores it would take the engine's core (BENCHMARKS.md)."""
    return int(os.environ.get("LLAMATERM_MASK_THREADS", 0)) or (2 if (os.cpu_count() or 1) >= 8 else 1)


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: Any, rows: Sequence[int] | None = None) -> None:
    """Row rows[i] (by default i) of `bitmask` := the tokens matchers[i] allows next: bit t % 32 of word t // 32 set
    for token t (llguidance.torch's layout; ids past the tokenizer's vocabulary never set). bitmask: a contiguous
    int32 CPU tensor [rows, ceil(vocabulary size / 32)]. Every row in one call to llguidance's pool, the GIL
    released throughout (a call a row would wait for the GIL after each), while the GPU runs the step."""
    import torch

    height, words = bitmask.shape
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("fill_bitmasks takes a contiguous int32 CPU tensor")
    rows = range(len(matchers)) if rows is None else rows
    if len(rows) != len(matchers) or not all(0 <= row < height for row in rows):  # llguidance writes where told
        raise ValueError(f"rows {list(rows)} of {len(matchers)} matchers for a bitmask of {height} rows")
    pairs = [(m._matcher, row) for m, row in zip(matchers, rows, strict=True)]
    _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, height)


def force_token(row: Any, token: int) -> None:
    """A bitmask row (as fill_bitmasks writes them; a numpy view) that allows `token` alone."""
    row[:] = 0
    row[token // 32] = (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)  # as int32


def accept_tokens(matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
    """accept(token) for every matcher and its sampled token. One after another on the caller's thread: a token
    costs microseconds, less than handing 64 of them to llguidance's threads."""
    return [m.accept(t) for m, t in zip(matchers, token_ids, strict=True)]
