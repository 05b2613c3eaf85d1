"""The grammar layer (engine/serving/grammar.py). The oracle: llguidance's own matcher on llguidance's own reading
of the vocabulary, from the Hugging Face tokenizer that transformers converts from the same GGUF
(llguidance.hf.from_tokenizer); answers are tokenized by our tokenizer, and bad grammars are refused by name."""

import codecs
import datetime
import json
from pathlib import Path
from typing import Literal

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field, ValidationError
from transformers import AutoTokenizer

from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import Grammar
from llamaterm.engine.serving import grammar
from llamaterm.engine.store.model_store import resolve_model
from tests.support.family_oracle import CONVERTER
from tests.support.tokenizer_files import (
    BYTE_LEVEL_TOKENS,
    MERGED,
    byte_level_meta,
    gguf_metadata,
    sentencepiece_meta,
    write_byte_level_gguf,
)

VOCABS = CONVERTER / "models"  # llama.cpp's test vocabularies (make test fetches them)
# json.dumps' layout, as the server asks llguidance for it
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]})
TREE = {  # recursive: a node's children are nodes
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["v", "kids"],
        }
    },
    "$ref": "#/$defs/node",
}
REGEX, LARK = r"(yes|no), because \w+!", 'start: "Answer: " n\nn: /[0-9]+/'
# (our grammar, llguidance's own grammar for the oracle, a valid answer, whether the answer completes the grammar)
CASES = [
    (Grammar("json_schema", json.dumps(PERSON)), llguidance.grammar_from("json", json.dumps(PERSON)), ANSWER, True),
    (
        Grammar("json_schema", json.dumps(TREE)),
        llguidance.grammar_from("json", json.dumps(TREE)),
        '{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]}',
        True,
    ),
    (Grammar("json"), llguidance.grammar_from("json", '{"type": "object"}'), '{"a": [1, {"b": null}], "c": "d"}', True),
    (Grammar("regex", REGEX), llguidance.grammar_from("regex", REGEX), "no, because reasons!", True),
    (Grammar("lark", LARK), llguidance.grammar_from("lark", LARK), "Answer: 12345", False),  # more digits may come
]


def oracle_grammar(source: str) -> str:
    """llguidance's grammar with the JSON layout set as the server sets it (its defaults are other)."""
    spec = json.loads(source)
    for g in spec["grammars"]:
        if g.get("json_schema") is not None:
            g["json_schema"] = {**g["json_schema"], "x-guidance": LAYOUT}
    return json.dumps(spec)


def allowed(mask: torch.Tensor) -> set[int]:
    bits = (mask.reshape(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


def walk(tokenizer: Tokenizer, oracle: llguidance.LLTokenizer, case) -> None:
    """Along the answer, token by token: our mask equals llguidance's own, allows the answer's next token; the
    answer ends the grammar (is_done), after which only the end-of-text tokens are allowed."""
    ours, source, answer, done = case
    vocab = grammar.vocabulary(tokenizer, tokenizer.vocab_size)
    matcher = vocab.matcher(ours)
    reference = llguidance.LLMatcher(oracle, oracle_grammar(source) if ours.kind.startswith("json") else source)
    assert not reference.is_error(), reference.get_error()
    mask, expected = (torch.zeros(1, vocab.words, dtype=torch.int32) for _ in range(2))
    # control tokens never match text; the oracle's tokenizer (transformers' reading of a GGUF) keeps some as text
    # (Phi-3's [PAD] ids)
    control = torch.zeros(1, vocab.words, dtype=torch.int32)
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i) and i not in tokenizer.stop_ids:
            control[0, i // 32] |= torch.tensor(1 << (i % 32)).to(torch.int32)
    for token in oracle.tokenize_str(answer):  # as a reply writes it: mid-text, with no SentencePiece prefix space
        grammar.fill_bitmasks([matcher], mask)
        llguidance.torch.fill_next_token_bitmask(reference, expected)
        assert torch.equal(mask, expected & ~control)
        assert token in allowed(mask)
        assert not matcher.is_done()
        assert matcher.accept(token) and reference.consume_token(token)
    grammar.fill_bitmasks([matcher], mask)
    assert matcher.is_done() == done and matcher.error() is None
    assert tokenizer.eos_id in allowed(mask) and (allowed(mask) <= tokenizer.stop_ids) == done


# ---- a tiny byte-level vocabulary, with ChatML's control tokens ----

TINY_TOKENS = [*BYTE_LEVEL_TOKENS, "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    meta = byte_level_meta(
        "llama-bpe",
        **{
            "tokenizer.ggml.tokens": TINY_TOKENS,
            "tokenizer.ggml.token_type": [1] * len(BYTE_LEVEL_TOKENS) + [3, 3, 3],
            "tokenizer.ggml.bos_token_id": TINY_TOKENS.index("<|im_start|>"),
            "tokenizer.ggml.eos_token_id": TINY_TOKENS.index("<|im_end|>"),
            "tokenizer.chat_template": "{{ messages[0].content }}",
        },
    )
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_byte_level_gguf(path, meta)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(tiny_gguf))


@pytest.fixture(scope="module")
def tiny_oracle(tiny_gguf, tiny) -> llguidance.LLTokenizer:
    hf = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    return llguidance.hf.from_tokenizer(hf, eos_token=sorted(tiny.stop_ids))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].kind)
def test_masks_agree_with_llguidance_on_a_tiny_vocabulary(tiny, tiny_oracle, case):
    walk(tiny, tiny_oracle, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].kind)
def test_masks_agree_with_llguidance_on_the_default_model_s_vocabulary(default, default_oracle, case):
    walk(default, default_oracle, case)


@pytest.fixture(scope="module")
def default() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata(resolve_model(None)))


@pytest.fixture(scope="module")
def default_oracle(default) -> llguidance.LLTokenizer:
    path = resolve_model(None)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return llguidance.hf.from_tokenizer(hf, eos_token=sorted(default.stop_ids))


STAFF = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "role": {"enum": ["Designer", "Manager", "Researcher"]},
        },
        "required": ["name", "age", "role"],
    },
}
STAFF_ANSWER = json.dumps(
    [
        {"name": "Ada", "age": 36, "role": "Designer"},
        {"name": "Bo", "age": 7, "role": "Manager"},
        {"name": "Cy", "age": 51, "role": "Researcher"},
    ]
)


def forced_runs(vocab: grammar.Vocabulary, oracle: llguidance.LLTokenizer) -> tuple[list[list[int]], int]:
    """Along STAFF_ANSWER, one sequence's forced runs (fast_forward), each checked against llguidance's own on a
    matcher of its own: the same, or its beginning, where a longer piece of the vocabulary begins with the forced
    text's end from within the first token ours leaves (the token after may merge with it). The tokens between runs
    are the rest of the text's first token. Returns the runs and the tokens llguidance forced."""
    ours = Grammar("json_schema", json.dumps(STAFF))
    matcher = vocab.matcher(ours)
    reference = llguidance.LLMatcher(oracle, oracle_grammar(llguidance.grammar_from("json", json.dumps(STAFF))))
    pieces = [oracle.decode_bytes([i]) for i in range(oracle.vocab_size) if not oracle.is_special_token(i)]
    rest, runs, theirs = STAFF_ANSWER.encode(), [], 0
    while rest:
        expected = reference.compute_ff_tokens()[:16]
        reference.consume_tokens(expected)
        if expected and reference.is_stopped():  # fast_forward leaves the last token for the sampler
            reference.rollback(1)
            expected.pop()
        reference.rollback(len(expected))
        run = matcher.fast_forward(16)
        assert run == expected[: len(run)]
        if len(run) < len(expected):
            text, start = oracle.decode_bytes(expected), len(oracle.decode_bytes(run))
            left = range(start, start + len(oracle.decode_bytes(expected[len(run) : len(run) + 1])))
            assert any(p.startswith(text[at:]) and len(p) > len(text) - at for at in left for p in pieces), text
        assert reference.consume_tokens(run)
        runs.append(run)
        theirs += len(expected)
        rest = rest[len(oracle.decode_bytes(run)) :]
        if rest:
            token = oracle.tokenize_bytes(rest)[0]
            assert matcher.accept(token) and reference.consume_token(token)
            rest = rest[len(oracle.decode_bytes([token])) :]
    assert matcher.is_done()
    return runs, theirs


@pytest.mark.slow
def test_forced_runs_are_llguidance_s_or_leave_a_mergeable_end_to_the_sampler(default, default_oracle):
    """A vocabulary keeps the runs of the texts grammars force (a key recurs in every record): a second sequence
    takes its runs from those kept; each is llguidance's own for its place, or that less a last token the token
    after may merge with, and they hold most of what llguidance forces."""
    vocab = grammar.Vocabulary(default, default.vocab_size)
    first, theirs = forced_runs(vocab, default_oracle)
    forced = sum(map(len, first))
    print(f"forced along the answer: {forced} tokens in {len(first)} runs; llguidance's own: {theirs}")
    assert forced >= 0.8 * theirs > 0 and vocab.forced_run.cache_info().currsize > 3
    assert forced_runs(vocab, default_oracle)[0] == first


@pytest.fixture(scope="module")
def phi3() -> Tokenizer:  # a SentencePiece vocabulary: llama.cpp's own for Phi-3's tokenizer tests
    return Tokenizer.from_gguf_metadata(gguf_metadata(VOCABS / "ggml-vocab-phi-3.gguf"))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].kind)
def test_masks_agree_with_llguidance_on_a_sentencepiece_vocabulary(phi3, case):
    hf = AutoTokenizer.from_pretrained(str(VOCABS), gguf_file="ggml-vocab-phi-3.gguf")
    walk(phi3, llguidance.hf.from_tokenizer(hf, eos_token=sorted(phi3.stop_ids)), case)


# ---- llguidance's own copy of the tokenizer ----


def count_python_tokenizer_calls(monkeypatch) -> list[bytes]:
    """Every text llguidance gives the Python tokenizer reader (grammar._Pieces) from now on."""
    calls: list[bytes] = []
    call = grammar._Pieces.__call__

    def counted(self, text):
        calls.append(text)
        return call(self, text)

    monkeypatch.setattr(grammar._Pieces, "__call__", counted)
    return calls


@pytest.mark.parametrize("which", ["tiny", "sentencepiece"])
def test_masks_tokenize_the_forced_text_without_calling_into_python(tiny, which, monkeypatch):
    """Masks under a JSON schema tokenize the text the grammar forces (`", "age": `); llguidance does it in its
    own copy of the tokenizer, so no mask waits for the GIL (grammar.native_tokenizer)."""
    tokenizer = tiny if which == "tiny" else Tokenizer.from_gguf_metadata(sentencepiece_meta())
    calls = count_python_tokenizer_calls(monkeypatch)
    vocab = grammar.Vocabulary(tokenizer, tokenizer.vocab_size)
    matcher, mask = vocab.matcher(CASES[0][0]), torch.zeros(1, vocab.words, dtype=torch.int32)
    for token in vocab._tokenizer.tokenize_str(ANSWER):
        grammar.fill_bitmasks([matcher], mask)
        assert token in allowed(mask) and matcher.accept(token)
    assert matcher.is_done() and calls == []


def test_a_tokenizer_llguidance_cannot_read_itself_is_read_through_python(tiny, tiny_oracle, monkeypatch):
    """Where llguidance cannot build the tokenizer from its spec, masks still agree with the oracle's, through the
    Python reader."""
    monkeypatch.setattr(Tokenizer, "spec", lambda self: "{}")
    calls = count_python_tokenizer_calls(monkeypatch)
    assert grammar.native_tokenizer(tiny, tiny.vocab_size, sorted(tiny.stop_ids)) is None
    grammar.vocabulary.cache_clear()
    try:
        walk(tiny, tiny_oracle, CASES[0])
    finally:
        grammar.vocabulary.cache_clear()
    assert calls


def test_a_vocabulary_cut_from_a_larger_tokenizer_spells_the_forced_text_with_its_own_pieces():
    """`bench -m synthetic:tiny`: 512 ids of the default model's tokenizer, whose encodings of the text a schema
    forces (`{"name": "`) fold ids past 512 into the vocabulary. The reader spells that text with the vocabulary's
    own pieces: the answer, written a token at a time from the masks, is accepted to the end and parses."""
    from llamaterm.engine.synthetic import SyntheticTokenizer

    tokenizer = SyntheticTokenizer(512)
    vocab = grammar.Vocabulary(tokenizer, 512)
    matcher, mask = vocab.matcher(CASES[0][0]), torch.zeros(1, vocab.words, dtype=torch.int32)
    text, answer = b"", ANSWER.encode()
    while not matcher.is_done():
        grammar.fill_bitmasks([matcher], mask)
        # the allowed token that spells the answer's longest next part (the masks decide what is allowed)
        token = max(
            (t for t in allowed(mask) if t < 512 and answer[len(text) :].startswith(tokenizer.token_bytes(t))),
            key=lambda t: len(tokenizer.token_bytes(t)),
        )
        assert matcher.accept(token), matcher.error()
        text += tokenizer.token_bytes(token)
    assert json.loads(text) == json.loads(ANSWER)


# ---- refusals ----


@pytest.mark.parametrize(
    "bad, refused",
    [
        ('{"name": 5', "5"),  # a number where a string goes
        ('{"name": "Ada", "age": "36"', '"'),  # a string where an integer goes
        ('["Ada"]', "["),  # an array, not an object
        ('{"name": "Ada", "age": 36}', "}"),  # "tags" is required
    ],
)
def test_an_invalid_answer_s_token_is_refused(tiny, bad, refused):
    vocab = grammar.vocabulary(tiny, tiny.vocab_size)
    matcher = vocab.matcher(CASES[0][0])
    mask = torch.zeros(1, vocab.words, dtype=torch.int32)
    ids = tiny.encode(bad, add_special=False)
    for token in ids:
        grammar.fill_bitmasks([matcher], mask)
        if token not in allowed(mask):
            assert tiny.decode([token]) == refused
            assert not matcher.accept(token)
            error = matcher.error()
            assert isinstance(error, RequestError) and "grammar" in str(error)
            assert not matcher.is_done() and not matcher.accept(ids[0])  # it stays refused
            return
        assert matcher.accept(token)
    raise AssertionError(f"every token of {bad!r} was allowed")


@pytest.mark.parametrize(
    "kind, text, words",
    [
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", "false", "no value matches"),
        ("json_schema", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ("json_schema", '{"type": "object", "if": {"required": ["a"]}}', '"if"'),
        ("json_schema", '{"not": {"type": "string"}}', '"not"'),
        ("json_schema", '{"type": "string", "format": "zipcode"}', "format: zipcode"),
        ("json_schema", '{"type": "frob"}', "frob"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "/$defs/missing"),
        ("json_schema", '{"$ref": "https://example.com/s.json"}', "https://example.com/s.json"),
        ("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}', "Unsatisfiable"),
        ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "minLength (5)"),
        ("json_schema", '{"type": "string", "pattern": "a(b"}', "unclosed group"),
        ("regex", "a(b", 'invalid regex "a(b": regex parse error: unclosed group'),
        ("regex", "[z-a]", "invalid character class range"),
        ("lark", "start: item\n", 'line 1, column 8: unknown name: "item"'),
        ("lark", "", "Empty grammar"),
    ],
)
def test_a_bad_grammar_is_refused_naming_the_part(kind, text, words):
    with pytest.raises(RequestError) as err:
        grammar.check(Grammar(kind, text))
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 300
    assert message.startswith(grammar.WHAT[kind])


def test_a_grammar_no_token_of_the_vocabulary_can_begin_is_refused():
    """A SentencePiece vocabulary without byte tokens, whose pieces hold no digit: "[0-9]+" compiles, and no token
    can begin it."""
    meta = sentencepiece_meta()
    keep = [i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if not t.startswith("<0x")]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        meta[key] = [meta[key][i] for i in keep]
    meta["tokenizer.ggml.eos_token_id"] = meta["tokenizer.ggml.tokens"].index("</s>")
    meta["tokenizer.ggml.bos_token_id"] = meta["tokenizer.ggml.tokens"].index("<s>")
    meta["tokenizer.ggml.unknown_token_id"] = 0
    letters = Tokenizer.from_gguf_metadata(meta)
    vocab = grammar.vocabulary(letters, letters.vocab_size)
    grammar.check(Grammar("regex", "[0-9]+"))
    with pytest.raises(RequestError, match="no token of the model's vocabulary begins it"):
        vocab.check(Grammar("regex", "[0-9]+"))
    vocab.check(Grammar("regex", "hello( world)?"))  # these it has
    assert "▁hello" in MERGED


# ---- the batched fill ----


def test_the_batched_fill_equals_row_by_row_fills(tiny):
    vocab = grammar.vocabulary(tiny, tiny.vocab_size)
    matchers, prefixes = [], ['{"name": "A', '{"v": 1, "kids": [', "", "no, bec", "Answer: 1"]
    for case, prefix in zip(CASES, prefixes, strict=True):
        matcher = vocab.matcher(case[0])
        assert all(matcher.accept(t) for t in tiny.encode(prefix, add_special=False))
        matchers.append(matcher)
    matchers.append(vocab.matcher(CASES[0][0]))  # the same grammar twice: copies that do not share a state
    batch = torch.full((len(matchers) + 2, vocab.words), 7, dtype=torch.int32)
    grammar.fill_bitmasks(matchers, batch)
    for row, matcher in enumerate(matchers):
        alone = torch.zeros(1, vocab.words, dtype=torch.int32)
        grammar.fill_bitmasks([matcher], alone)
        assert torch.equal(batch[row], alone[0])
    assert (batch[len(matchers) :] == 7).all()  # rows without a matcher are left as they were
    assert not torch.equal(batch[0], batch[1])
    at_rows = torch.full_like(batch, 7)  # each at a row of its own (the engine's: its sequence's sampler slot)
    rows = [len(matchers) + 1 - i for i in range(len(matchers))]
    grammar.fill_bitmasks(matchers, at_rows, rows)
    assert all(torch.equal(at_rows[row], batch[i]) for i, row in enumerate(rows))
    assert (at_rows[:2] == 7).all()

    tokens = [tiny.encode('"', add_special=False)[0]] * 2
    # '"' ends the name of the first; the last, at the start, wants "{"
    assert grammar.accept_tokens(matchers[:1] + matchers[-1:], tokens) == [True, False]


def test_ids_past_the_tokenizer_s_vocabulary_are_never_allowed(tiny):
    """A model's embedding may have more rows than its tokenizer has tokens: the bitmask covers them all, and
    those ids match nothing."""
    size = tiny.vocab_size + 70
    vocab = grammar.vocabulary(tiny, size)
    assert vocab.words == (size + 31) // 32
    mask = torch.zeros(1, vocab.words, dtype=torch.int32)
    grammar.fill_bitmasks([vocab.matcher(Grammar("regex", r"(.|\n)*"))], mask)
    ids = allowed(mask)
    assert max(ids) < tiny.vocab_size
    # every token that can begin UTF-8 text (not a lone continuation byte), and the end
    text = {i for i in range(tiny.vocab_size) if not tiny.is_special(i) and utf8_prefix(tiny.token_bytes(i))}
    assert ids == text | tiny.stop_ids and len(text) > 150


def utf8_prefix(data: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


def test_fill_bitmasks_refuses_a_mask_of_the_wrong_kind(tiny):
    vocab = grammar.vocabulary(tiny, tiny.vocab_size)
    matcher = vocab.matcher(Grammar("json"))
    for bad in (torch.zeros(1, vocab.words, dtype=torch.int64), torch.zeros(vocab.words, 2, dtype=torch.int32).T):
        with pytest.raises(ValueError):
            grammar.fill_bitmasks([matcher], bad)
    one_row = torch.zeros(1, vocab.words, dtype=torch.int32)
    with pytest.raises(ValueError, match="of 2 matchers for a bitmask of 1 rows"):
        grammar.fill_bitmasks([matcher, matcher], one_row)
    with pytest.raises(ValueError, match=r"rows \[1\] of 1 matchers for a bitmask of 1 rows"):
        grammar.fill_bitmasks([matcher], one_row, [1])  # past the end: llguidance would write out of bounds


def test_a_grammar_too_long_to_cache_is_compiled_each_time(tiny):
    """Clients could fill a cache of long grammars until memory runs out: those are compiled and dropped."""
    words = [f"w{i}" for i in range(20_000)]
    big = Grammar("regex", "|".join(words))
    assert len(big.text) > grammar.CACHED_CHARS
    cached = grammar._compiled_cached.cache_info().currsize
    matcher = grammar.vocabulary(tiny, tiny.vocab_size).matcher(big)
    assert all(matcher.accept(t) for t in tiny.encode(words[-1], add_special=False)) and matcher.is_done()
    assert grammar._compiled_cached.cache_info().currsize == cached


class Address(BaseModel):
    street: str = Field(max_length=40)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    """What clients send most: a pydantic model's schema, as the openai client writes it for parse()."""

    name: str
    age: int = Field(ge=0, le=150)
    born: datetime.date
    seen: datetime.datetime
    kind: Literal["friend", "colleague"]
    nick: str | None
    addresses: list[Address] = Field(min_length=1, max_length=2)
    boss: "Person | None"
    scores: dict[str, float]


ADA = Person(
    name="Ada",
    age=36,
    born=datetime.date(1815, 12, 10),
    seen=datetime.datetime(1843, 9, 1, 12, 30, tzinfo=datetime.UTC),
    kind="friend",
    nick=None,
    addresses=[Address(street="St James's Square", zip="12345")],
    boss=None,
    scores={"math": 9.5},
)


@pytest.mark.parametrize("schema", [to_strict_json_schema(Person), Person.model_json_schema()], ids=["strict", "plain"])
def test_a_pydantic_model_s_schema_takes_its_instances_and_refuses_others(tiny, schema):
    vocab = grammar.vocabulary(tiny, tiny.vocab_size)
    wanted = Grammar("json_schema", json.dumps(schema))
    matcher = vocab.matcher(wanted)
    assert all(matcher.accept(t) for t in tiny.encode(json.dumps(ADA.model_dump(mode="json")), add_special=False))
    assert matcher.is_done()
    for field, bad in (("age", 151), ("kind", "enemy"), ("addresses", []), ("born", "1815-13-10")):
        text = json.dumps(ADA.model_dump(mode="json") | {field: bad})
        with pytest.raises(ValidationError):
            Person.model_validate_json(text)  # the oracle: pydantic refuses it too
        matcher = vocab.matcher(wanted)
        assert not all(matcher.accept(t) for t in tiny.encode(text, add_special=False)), field
