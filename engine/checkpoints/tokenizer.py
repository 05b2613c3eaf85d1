"""The tokenizer: text <-> token ids, chat prompts, and streaming detokenization.

Encoding runs in the `tokenizers` library. For GGUF files it is rebuilt from the metadata the way llama.cpp
tokenizes (llama.cpp's src/llama-vocab.cpp): byte-level BPE (`gpt2`) with the pre-tokenizer regexes of the
file's pre type, or SentencePiece BPE (`llama`) with scores and byte fallback. Folders bring tokenizer.json.

Decoding is ours: every token maps once to the bytes it stands for, so decode and the incremental detokenizer
concatenate bytes and decode UTF-8, O(1) per token. It is lossless: no clean-up of spaces around punctuation.
"""

import codecs
import json
import re
import threading
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from llamaterm.engine import harmony
from llamaterm.engine.checkpoints.chat_template import CHATML_TEMPLATE, ChatTemplate
from llamaterm.engine.checkpoints.fields import read, reader
from llamaterm.engine.checkpoints.hf_files import chat_template_source, read_json, read_text
from llamaterm.engine.errors import ModelFormatError, RequestError

# llama.cpp token types (gguf-py TokenType), as stored in tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn or a text: llama.cpp's end-of-generation names (llama-vocab.cpp), plus
# Llama 3's <|end_of_text|>, which a file whose eos is <|eot_id|> would otherwise let through
END_OF_TURN = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>", "<|end|>", "<|endoftext|>"}
    | {"<end_of_turn>", "<EOT>", harmony.RETURN, harmony.CALL}
)

# Pre-tokenizer regexes by tokenizer.ggml.pre, applied in order (llama-vocab.cpp, llm_tokenizer_bpe)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
_GPT4O_SPLIT = (  # the regex of o200k's tokenizer.json (Phi-4-mini), as llama.cpp gives it for the "gpt-4o" pre-type
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "gpt-2": (_GPT2_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,),
}
# Llama 3 vocabularies take a pre-token that is a whole vocabulary entry as is, and add BOS by default
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3"})

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Stand-ins for special-token text in chat messages while the template renders: Unicode's private-use plane 15.
# Templates keep them through what they do to content (strip, trim, split at </think>, +): they are not whitespace,
# have no case and are in no marker. A template that drops or escapes one (tojson with ensure_ascii) drops or escapes
# the text it stands for, which then is no special token either; one that looks for special-token text in a message
# does not find it
_STAND_INS = range(0xF0000, 0xFFFFE)


def encode_releasing_gil(backend: tokenizers.Tokenizer, text: str) -> tokenizers.Encoding:
    """backend.encode(text) without special tokens added. Through encode_batch, which lets other threads run while
    it works (encode holds the GIL): a megabyte of prompt takes seconds, and a server's streams go on meanwhile."""
    return backend.encode_batch([text], add_special_tokens=False)[0]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level spelling, inverted: each of the 256 characters a token is written in -> its byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
# str.translate's table from the alphabet to the bytes as latin-1 characters; a character below 256 outside it
# becomes one that latin-1 cannot encode, as any above 256 outside it is, so a token of both kinds fails to encode
_TO_LATIN1 = {c: 0xFFFF for c in range(256)} | {ord(c): b for c, b in _BYTE_OF_CHAR.items()}


def _piece_bytes(token: str, token_type: int, byte_level: bool) -> bytes:
    """The bytes a token stands for in decoded text."""
    if token_type in (CONTROL, USER_DEFINED, UNKNOWN):
        return token.encode()  # added tokens are stored as plain text in both kinds of vocabulary
    if byte_level:
        try:
            return token.translate(_TO_LATIN1).encode("latin-1")  # (a whole vocabulary in C: 128k tokens)
        except UnicodeEncodeError:  # outside the byte alphabet: plain text, as the tokenizers library decodes it
            return token.encode()
    if token_type == BYTE and _BYTE_TOKEN.fullmatch(token):
        return bytes([int(token[3:5], 16)])  # <0xNN>
    return token.replace("▁", " ").encode()


def check_unicode(text: str) -> None:
    """Text the tokenizer can take: a lone surrogate (JSON's "\\ud800", or an undecodable byte that Python's
    surrogateescape kept from argv or stdin) is not Unicode text, and the tokenizers library fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"the text is not valid Unicode: {text[e.start]!r} at character {e.start} (a lone "
            "surrogate, or a byte that is not UTF-8): give UTF-8 text"
        ) from None


class Tokenizer:
    """Build with from_gguf_metadata or from_hf_dir. Thread-safe: encode takes a lock, the rest reads only."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokens: list[str],
        token_types: list[int],
        *,
        byte_level: bool,
        strip_leading_space: bool,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        extra_stop_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
    ):
        if add_bos and bos_id is None:
            raise ModelFormatError("the tokenizer says to add a BOS token but names none")
        if add_eos and eos_id is None:
            raise ModelFormatError("the tokenizer says to add an EOS token but names none")
        # decoding is ours (below); the backend's decoder only tells readers of spec() how tokens spell bytes
        backend.decoder = (
            decoders.ByteLevel()
            if byte_level
            else decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        )
        self._backend = backend
        self._tokens = tokens
        self._pieces = [_piece_bytes(t, ty, byte_level) for t, ty in zip(tokens, token_types, strict=True)]
        self._special = frozenset(i for i, ty in enumerate(token_types) if ty in (CONTROL, UNKNOWN))
        # SentencePiece writes a word's leading space as part of the token; the first one in a text is the
        # space it added in front of the text, so decoding drops it
        self._strip_leading_space = strip_leading_space
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self._bos = [bos_id] if add_bos and bos_id is not None else []  # what encode adds at each end
        self._eos = [eos_id] if add_eos and eos_id is not None else []
        named = {i for i in self._special if tokens[i] in END_OF_TURN}
        stops = ({eos_id} if eos_id is not None else set()) | named | set(extra_stop_ids)
        self.stop_ids = frozenset(stops - _harmony_message_ends(tokens, self._special))
        self._chat_template_source = chat_template
        self._encode_lock = threading.Lock()  # encode_special_tokens is a setting on the shared backend

    # ---- construction ----

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """From GGUF metadata (every key -> its value: numeric arrays as numpy arrays, string arrays as lists)."""
        get = reader("GGUF metadata")
        tokens = get(meta, "tokenizer.ggml.tokens", "strings")
        if not tokens:
            raise ModelFormatError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        n = len(tokens)
        token_types = get(meta, "tokenizer.ggml.token_type", "ints")
        if token_types is not None and len(token_types) != n:
            raise ModelFormatError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
        token_types = [NORMAL] * n if token_types is None else [int(t) for t in token_types]

        def token_id(key: str) -> int | None:
            value = get(meta, f"tokenizer.ggml.{key}", int)
            if value is not None and not 0 <= value < n:
                raise ModelFormatError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary of {n} tokens")
            return value

        model = get(meta, "tokenizer.ggml.model", str)
        if model == "gpt2":
            pre = get(meta, "tokenizer.ggml.pre", str, "default")
            backend = _byte_level_bpe(tokens, get(meta, "tokenizer.ggml.merges", "strings"), pre)
            add_bos_default, add_space_prefix = pre in _LLAMA3_PRES, False
        elif model == "llama":
            add_space_prefix = bool(get(meta, "tokenizer.ggml.add_space_prefix", bool, True))
            unk_id = token_id("unknown_token_id")
            scores = get(meta, "tokenizer.ggml.scores", "numbers")
            backend = _sentencepiece_bpe(
                tokens,
                None if scores is None or len(scores) != n else [float(x) for x in scores],
                None if unk_id is None else tokens[unk_id],
                add_space_prefix,
            )
            add_bos_default = True
        else:
            raise ModelFormatError(
                f"tokenizer model {model!r} is not supported: llamaterm reads 'gpt2' (byte-level BPE) and "
                "'llama' (SentencePiece)"
            )
        # Added tokens are matched whole in the text; special ones only when asked (encode's parse_special)
        typed = list(zip(tokens, token_types, strict=True))
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty in (CONTROL, UNKNOWN)]
        )
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == USER_DEFINED])
        stops = tuple(i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None)
        bos_id = token_id("bos_token_id")
        return cls(
            backend,
            tokens,
            token_types,
            byte_level=model == "gpt2",
            strip_leading_space=add_space_prefix,
            bos_id=bos_id,
            eos_id=token_id("eos_token_id"),
            add_bos=bool(get(meta, "tokenizer.ggml.add_bos_token", bool, add_bos_default and bos_id is not None)),
            add_eos=bool(get(meta, "tokenizer.ggml.add_eos_token", bool, False)),
            extra_stop_ids=stops,
            chat_template=get(meta, "tokenizer.chat_template", str),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, model_vocab_size: int = 0) -> "Tokenizer":
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json.

        model_vocab_size: the rows of the model's embedding. Models pad it beyond the tokenizer's ids (Qwen2.5:
        152064 rows for 151665 tokens); those ids decode to nothing, as they do in transformers (llama.cpp's
        converter pads the GGUF vocabulary with [PAD] tokens to the same end)."""
        folder = Path(path)
        spec_text = read_text(folder / "tokenizer.json")
        if spec_text is None:
            raise ModelFormatError(f"{folder}: no tokenizer.json (llamaterm needs the fast-tokenizer file)")
        try:
            spec = json.loads(spec_text)
            backend = tokenizers.Tokenizer.from_str(spec_text)
        except Exception as err:  # the library raises plain Exceptions on a malformed file
            raise ModelFormatError(f"{folder / 'tokenizer.json'}: cannot be read: {err}") from err
        config = read_json(folder / "tokenizer_config.json")
        generation = read_json(folder / "generation_config.json")

        byte_level, strip_leading_space = _hf_decoding(spec, folder / "tokenizer.json")
        tokens, token_types = _hf_vocabulary(spec, backend, byte_level, model_vocab_size, folder / "tokenizer.json")

        def config_token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):  # saved as an AddedToken
                token = token.get("content")
            return (
                None
                if token is None
                else backend.token_to_id(read({name: token}, name, str, where=str(folder / "tokenizer_config.json")))
            )

        bos_id, eos_id = config_token_id("bos_token"), config_token_id("eos_token")
        # Without add_bos_token in the config, the post-processor shows what to add (Llama 3 adds BOS there)
        added = backend.encode("", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and added[:1] == [bos_id]
        add_eos = config.get("add_eos_token")
        if add_eos is None:
            add_eos = eos_id is not None and len(added) > int(add_bos) and added[-1] == eos_id
        # Instruct models list their end-of-turn tokens here (Llama 3.1: end_of_text, eom_id, eot_id)
        generation_eos = generation.get("eos_token_id")
        if not isinstance(generation_eos, list):
            generation_eos = [] if generation_eos is None else [generation_eos]
        extra_stops = tuple(
            read({"eos_token_id": generation_eos}, "eos_token_id", "ints", where=str(folder / "generation_config.json"))
        )

        return cls(
            backend,
            tokens,
            token_types,
            byte_level=byte_level,
            strip_leading_space=strip_leading_space,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            extra_stop_ids=extra_stops,
            chat_template=chat_template_source(folder),
        )

    # ---- encoding ----

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it (e.g. 'Ġworld' or '▁world'); decode() gives its text."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for in decoded text (a special token's: its name, as text)."""
        return self._piece(token_id)

    def is_special(self, token_id: int) -> bool:
        """A control token (<|im_start|>, </s>): never part of a text, only of the template's markup."""
        self._check_id(token_id)
        return token_id in self._special

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids. add_special adds BOS/EOS as the model asks; parse_special turns text such as
        '<|im_start|>' into its control token (off for user text, so it cannot forge turns)."""
        check_unicode(text)
        with self._encode_lock:
            self._backend.encode_special_tokens = not parse_special
            ids = encode_releasing_gil(self._backend, text).ids
        if add_special:
            ids = self._bos + ids + self._eos
        return ids

    def spec(self) -> str:
        """The encoder as a `tokenizers` JSON document, its decoder saying how tokens spell bytes (byte-level, or
        SentencePiece's with byte fallback): for libraries that rebuild the tokenizer in their own code
        (llguidance, engine/serving/grammar.py)."""
        return self._backend.to_str()

    # ---- chat ----

    @cached_property
    def chat_template(self) -> ChatTemplate:
        # Compiled on first use, so a model with a broken template still loads for raw prompts
        return ChatTemplate(self._chat_template_source or CHATML_TEMPLATE)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """Messages ({'role', 'content'}, and OpenAI's tool_calls and tool replies) -> prompt text by the model's
        template (ChatML if it has none). enable_thinking: the template's thinking switch, where it has one (None:
        its default). tools: OpenAI's function tools, for templates that render them (engine/tool_calls.py).
        reasoning_effort: gpt-oss's "low", "medium" or "high" (None: its template's default)."""
        return self._render(
            self._for_template(messages), add_generation_prompt, enable_thinking, tools, reasoning_effort
        )

    def _for_template(self, messages: list[dict]) -> list[dict]:
        """The messages as the model's template reads them: gpt-oss's takes earlier thinking apart from the content
        (engine/harmony.py); any other, as they are."""
        return harmony.for_template(messages) if harmony.speaks_harmony(self.chat_template.source) else messages

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        tools: list[dict] | None,
        reasoning_effort: str | None,
    ) -> str:
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="" if self.bos_id is None else self._tokens[self.bos_id],
            eos_token="" if self.eos_id is None else self._tokens[self.eos_id],
            enable_thinking=enable_thinking,
            tools=tools,
            reasoning_effort=reasoning_effort,
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
    ) -> list[int]:
        """The prompt's ids: the template's markers parsed as special tokens, BOS added once if the model asks.

        Special-token text inside a message stays text, so a message cannot forge a turn ('<|im_end|>' in a user's
        content is the tokens of those characters); so does such text in a tool's description or a call's
        arguments, at any depth. The template renders the message with a stand-in character in
        place of that text; the rendered prompt is cut at the template's own special tokens, and each stretch
        between them, the text put back, is encoded with special-token parsing off. A prompt without such text is
        encoded whole, as the model's own tokenizer encodes it: stretches encoded apart can differ where they were
        cut (a Hugging Face Metaspace pre-tokenizer with prepend_scheme "first" puts '▁' before each)."""
        # (shaped before hiding: gpt-oss's earlier replies are read for their markup)
        (hidden, hidden_tools), stand_ins = self._hide_special_text((self._for_template(messages), tools))
        text = self._render(hidden, add_generation_prompt, enable_thinking, hidden_tools, reasoning_effort)
        if stand_ins:
            runs, specials = self._split_at_special_tokens(text)
            ids = self.encode(runs[0].translate(stand_ins), add_special=False)
            for (token_id, _), run in zip(specials, runs[1:], strict=True):
                ids += [token_id, *self.encode(run.translate(stand_ins), add_special=False)]
        else:
            ids = self.encode(text, add_special=False, parse_special=True)
        if ids[: len(self._bos)] != self._bos:  # templates such as Llama 3's write BOS themselves
            ids[:0] = self._bos
        return ids

    def token_id(self, text: str) -> int | None:
        """The id of the one token that `text` is, special tokens too (Qwen's '<tool_call>', Mistral's
        '[TOOL_CALLS]'), or None where the vocabulary spells it in several."""
        ids = self.encode(text, add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    def _hide_special_text(self, value: Any) -> tuple[Any, dict[int, str]]:
        """The value (messages, tools: dicts and lists nested) with the special-token text in its strings swapped
        for stand-in characters, and the str.translate table that swaps it back; the value as given where it
        holds none."""
        strings = list(_strings(value))
        for s in strings:
            check_unicode(s)
        cut = {s: self._split_at_special_tokens(s) for s in strings}
        found = dict.fromkeys(text for _, specials in cut.values() for _, text in specials)
        if not found:
            return value, {}
        # A stand-in must come from nowhere else in the rendered text: not the template, not a message
        used = set(self.chat_template.source).union(*strings)
        free = (c for c in map(chr, _STAND_INS) if c not in used)
        stand_in = dict(zip(found, free, strict=False))
        if len(stand_in) < len(found):
            raise RequestError("the messages use up every private-use character of Unicode's plane 15")

        def hide(v: Any) -> Any:
            if isinstance(v, str):
                runs, specials = cut[v]
                return runs[0] + "".join(stand_in[t] + run for (_, t), run in zip(specials, runs[1:], strict=True))
            if isinstance(v, dict):
                return {k: hide(x) for k, x in v.items()}
            return [hide(x) for x in v] if isinstance(v, list | tuple) else v

        return hide(value), {ord(c): text for text, c in stand_in.items()}

    def _split_at_special_tokens(self, text: str) -> tuple[list[str], list[tuple[int, str]]]:
        """Where encode(text, parse_special=True) finds special tokens: the stretches of text between them (one
        more than the tokens) and the tokens, as (id, the text matched)."""
        encoding = encode_releasing_gil(self._added_token_finder, text)
        runs, specials, start = [], [], 0
        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self._special:
                runs.append(text[start:begin])
                specials.append((token_id, text[begin:end]))
                start = end
        return [*runs, text[start:]], specials

    @cached_property
    def _added_token_finder(self) -> tokenizers.Tokenizer:
        """The backend's added tokens alone, found in a text as the backend finds them (the same tokens, the same
        normalizer); each stretch of other text comes out as one token of id vocab_size, an id of no token."""
        added = self._backend.get_added_tokens_decoder()
        vocab = {t.content: i for i, t in added.items()} | {"": self.vocab_size}
        finder = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=""))
        finder.normalizer = self._backend.normalizer
        finder.add_tokens(list(added.values()))
        return finder

    # ---- decoding ----

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        pieces = [self._piece(i) for i in ids if not (skip_special and i in self._special)]
        if pieces and self._strip_leading_space:
            pieces[0] = pieces[0].removeprefix(b" ")
        return b"".join(pieces).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = False) -> "Detokenizer":
        """A streaming decoder for one sequence: the concatenation of its outputs equals decode(ids)."""
        return Detokenizer(self, skip_special)

    def _piece(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._pieces[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")


def _harmony_message_ends(tokens: list[str], special: frozenset[int]) -> set[int]:
    """In harmony's vocabulary (o200k_harmony: gpt-oss), <|end|> ends a message of the reply, not the reply, which
    <|return|> and <|call|> end: where all three are special tokens, <|end|>'s id, as llama.cpp decides it."""
    ids = {tokens[i]: i for i in special if tokens[i] in harmony.ENDS}
    return {ids[harmony.END]} if len(ids) == len(harmony.ENDS) else set()


def _strings(value: Any) -> Iterator[str]:
    """Every string value in dicts and lists nested (not the keys: the template's own names)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


class Detokenizer:
    """Text of a sequence as its tokens arrive. push() returns only complete characters: the bytes of a UTF-8
    character split across tokens (an emoji in a byte-level vocabulary) wait until its last byte comes."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._first = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        tok = self._tokenizer
        if self._skip_special and token_id in tok._special:
            return ""
        piece = tok._piece(token_id)
        if self._first:
            self._first = False
            if tok._strip_leading_space:
                piece = piece.removeprefix(b" ")
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """The end of the sequence: held bytes of an unfinished character come out as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str) -> tokenizers.Tokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        known = ", ".join(sorted(PRE_TOKENIZER_SPLITS))
        raise ModelFormatError(f"tokenizer pre-type {pre!r} is not supported (llamaterm knows {known})")
    if not merges:
        raise ModelFormatError("the GGUF byte-level tokenizer has no merges (tokenizer.ggml.merges)")
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)  # "left right"; a part never holds a real space in a byte-level vocabulary
        if cut < 0:
            raise ModelFormatError(f"tokenizer.ggml.merges holds a malformed merge {merge!r}")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(_bpe(vocab, pairs, ignore_merges=pre in _LLAMA3_PRES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return backend


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float] | None, unk_token: str | None, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become '▁', one more goes in front of each run of text
    (after each special token too), then the adjacent pair whose union scores best merges first; characters
    outside the vocabulary fall back to <0xNN> byte tokens."""
    if scores is None or len(scores) != len(tokens):
        raise ModelFormatError("the GGUF SentencePiece tokenizer needs one score per token (tokenizer.ggml.scores)")
    vocab = {t: i for i, t in enumerate(tokens)}
    # The same rule as ranked merges: every split of a token into two vocabulary pieces, best score first
    # (a stable sort keeps vocabulary order between equal scores)
    merges = [
        (token[:k], token[k:], scores[i])
        for token, i in vocab.items()
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    ]
    merges.sort(key=lambda m: -m[2])
    backend = tokenizers.Tokenizer(
        _bpe(vocab, [(a, b) for a, b, _ in merges], unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    escape = [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if add_space_prefix else []) + escape)
    return backend


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options) -> models.BPE:
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as err:  # the library raises plain Exceptions, e.g. a merge of tokens not in the vocabulary
        raise ModelFormatError(f"the GGUF tokenizer does not build: {err}") from None


def _hf_decoding(spec: dict, where: Path) -> tuple[bool, bool]:
    """(byte_level, strip_leading_space) from tokenizer.json's decoders: byte-level BPE, or SentencePiece-style
    pieces (byte fallback, a metaspace) whose leading space the decoder may strip."""
    decoders = _flatten_decoders(spec.get("decoder"))
    kinds = {d.get("type") for d in decoders}
    if "ByteLevel" in kinds:
        byte_level, strip_leading_space = True, False
    elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
        byte_level = False
        strip_leading_space = "Strip" in kinds or any(
            d.get("type") == "Metaspace" and (d.get("prepend_scheme", "never") != "never" or d.get("add_prefix_space"))
            for d in decoders
        )
    else:
        raise ModelFormatError(f"{where}: unsupported decoder {sorted(map(str, kinds))}")
    return byte_level, strip_leading_space


def _hf_vocabulary(
    spec: dict, backend: tokenizers.Tokenizer, byte_level: bool, model_vocab_size: int, where: Path
) -> tuple[list[str], list[int]]:
    """Every id's token and type, ids the tokenizer lacks up to the model's vocabulary size as UNUSED."""
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:
        raise ModelFormatError(f"{where}: the vocabulary is empty")
    token, top = max(vocab.items(), key=lambda item: item[1])
    if top >= 2 * len(vocab):  # ids index a table of max id + 1 entries: a sparse one is a damaged file
        raise ModelFormatError(
            f"{where}: token {token!r} has id {top}, far beyond the "
            f"{len(vocab)} tokens of the vocabulary; the file is damaged"
        )
    tokens = [""] * max(top + 1, model_vocab_size)
    token_types = [UNUSED] * len(tokens)
    for token, i in vocab.items():
        tokens[i] = token
        token_types[i] = BYTE if not byte_level and _BYTE_TOKEN.fullmatch(token) else NORMAL
    for added in spec.get("added_tokens") or []:
        if not (isinstance(added, dict) and vocab.get(str(added.get("content"))) == added.get("id")):
            raise ModelFormatError(f"{where}: added token {str(added)[:60]} is not in the vocabulary")
        token_types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    return tokens, token_types


def _flatten_decoders(decoder) -> list[dict]:
    """The decoders of a tokenizer.json, sequences flattened; anything that is not a decoder object is dropped (and
    then found missing)."""
    if isinstance(decoder, list):
        return [d for sub in decoder for d in _flatten_decoders(sub)]
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return _flatten_decoders(decoder.get("decoders"))
    return [decoder]
