"""Tokenizer tests. The oracles: llama.cpp's ids for the default model (tests/data/smollm2_tokenizer.json, made
with llama-cpp-python 0.3.36's tokenizer on the same GGUF), transformers (its chat
template rendering, its tokenizers converted from GGUF), and ids worked out by hand from llama.cpp's
SentencePiece rules where llama.cpp and transformers differ."""

import json
import time
from pathlib import Path

import gguf
import jinja2
import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.engine.checkpoints.checkpoint_info import read_checkpoint
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import ModelFormatError, RequestError
from llamaterm.engine.store.model_store import resolve_model
from tests.support import DATA
from tests.support.fuzz import byte_level_tokenizer_json
from tests.support.safetensors_files import write_dense
from tests.support.tokenizer_files import (
    BOS,
    BYTE_LEVEL_TOKENS,
    EOS,
    SP,
    byte_level_meta,
    gguf_metadata,
    sentencepiece_meta,
    write_byte_level_gguf,
    write_gguf,
)

VECTORS = json.loads((DATA / "smollm2_tokenizer.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def smollm_meta() -> dict:
    return gguf_metadata(resolve_model(None))


@pytest.fixture(scope="module")
def smollm(smollm_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_meta)


# ---- the default model (byte-level BPE, pre-type smollm) against llama.cpp ----


@pytest.mark.parametrize("case", VECTORS, ids=[f"case{i}" for i in range(len(VECTORS))])
def test_llama_cpp_vectors(smollm, case):
    assert smollm.encode(case["text"], add_special=False) == case["ids"]
    assert smollm.encode(case["text"], add_special=False, parse_special=True) == case["ids_parse_special"]
    assert smollm.decode(case["ids"]) == case["text"]
    assert smollm.decode(case["ids_parse_special"]) == case["text"]


def test_default_model_special_tokens(smollm):
    # the GGUF's own metadata: <|endoftext|> 0, <|im_start|> 1 (bos), <|im_end|> 2 (eos); add_bos_token is false
    assert (smollm.bos_id, smollm.eos_id, smollm.add_bos, smollm.vocab_size) == (1, 2, False, 49152)
    assert smollm.stop_ids == {0, 2}  # eos, and <|endoftext|>: llama.cpp ends generation on both
    assert smollm.token_text(1) == "<|im_start|>"
    assert smollm.token_text(905) == "Ġworld"  # " world" in the vectors
    assert smollm.encode("Hello world") == [19556, 905]  # add_special adds nothing here
    ids = [1, 4093, 198, 26843, 2]  # "<|im_start|>user\nHi<|im_end|>" with special tokens parsed
    assert smollm.decode(ids, skip_special=True) == "user\nHi"
    with pytest.raises(ValueError):
        smollm.decode([49152])


def test_default_model_builds_fast(smollm_meta):
    start = time.perf_counter()
    Tokenizer.from_gguf_metadata(smollm_meta)
    assert time.perf_counter() - start < 5  # about 0.15 s here; generous for a busy CI machine


# ---- chat templates ----

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 🦙"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_default_template_renders_like_transformers(smollm, smollm_meta, messages, add_generation_prompt):
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=smollm_meta["tokenizer.chat_template"],
        add_generation_prompt=add_generation_prompt,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    assert smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == rendered[0]


def test_default_template_is_chatml(smollm):
    # The literal special-token strings of SmolLM2's tokenizer_config.json
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert smollm.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        system + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert smollm.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


FEATURES_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{{ bos_token }}{{ m | tojson }}{{ m.content | tojson(indent=2) }}{{ eos_token }}\n{% endfor %}"
    "{% if tools is not none %}tools{% endif %}{{ strftime_now('%Y') | length }}"
    "{% generation %}{{ 'marked' }}{% endgeneration %}"
)


def test_template_features_render_like_transformers():
    messages = [
        {"role": "user", "content": "naïve “quotes” <b>&</b>"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "ok"},
        {"role": "stop", "content": "y"},
        {"role": "user", "content": "never"},
    ]
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": FEATURES_TEMPLATE}))
    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=FEATURES_TEMPLATE, bos_token="<s>", eos_token="</s>"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == rendered[0]


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ (''|attr('__class__')).__mro__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages.append('forged') }}",  # the sandbox is immutable: a template cannot edit the conversation
]


@pytest.mark.parametrize("template", ESCAPES)
def test_template_sandbox(template, tmp_path):
    marker = tmp_path / "marker"
    template = template.replace("MARKER", str(marker))
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": template}))
    with pytest.raises(ModelFormatError) as err:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert isinstance(err.value.__cause__, jinja2.exceptions.SecurityError)
    assert not marker.exists()


def test_template_errors():
    refuses = "{{ raise_exception('Conversation roles must alternate') }}"
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": refuses}))
    with pytest.raises(RequestError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    broken = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": "{% for m in %}"}))
    with pytest.raises(ModelFormatError, match="does not parse"):
        broken.apply_chat_template([{"role": "user", "content": "Hi"}])
    undefined = "{{ messages[0].content + messages[0].missing }}"
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": undefined}))
    with pytest.raises(ModelFormatError, match="UndefinedError"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_missing_template_falls_back_to_chatml():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", ["{{ bos_token }}{{ messages[0].content }}", "{{ messages[0].content }}"])
def test_chat_prompt_has_one_bos(template):
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.chat_template": template}))
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids == [BOS, SP["▁hello"]]


# ---- incremental detokenizer ----

MULTIBYTE = [
    "emoji 🦙🚀👍🏽 and flags 🇫🇷",
    "日本語のテキストと中文混合",
    "naïve café résumé – “quotes” — dashes…",
    "Ελληνικά και русский текст",
    "नमस्ते दुनिया",
    "Ünïcödé ÅÄÖ ß ﬁ ligature",
]


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    detok = tok.detokenizer(skip_special)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_detokenizer_byte_level(smollm, text):
    ids = smollm.encode(text, add_special=False)
    deltas = stream(smollm, ids)
    assert "".join(deltas) == text == smollm.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    shown = ""
    for d in deltas:  # every delta extends the text correctly: nothing is emitted early or twice
        shown += d
        assert text.startswith(shown)


def test_detokenizer_holds_split_characters(smollm):
    ids = smollm.encode("🦙", add_special=False)  # one character, several byte-level tokens
    assert len(ids) > 1
    assert stream(smollm, ids) == [""] * (len(ids) - 1) + ["🦙", ""]
    # a sequence that ends inside a character: the held bytes come out as U+FFFD, as decode() shows them
    assert "".join(stream(smollm, ids[:-1])) == smollm.decode(ids[:-1]) == "\ufffd"


def test_detokenizer_all_vectors(smollm):
    for case in VECTORS:
        for ids, skip in ((case["ids"], False), (case["ids_parse_special"], True)):
            deltas = stream(smollm, ids, skip)
            assert "".join(deltas) == smollm.decode(ids, skip_special=skip)
            assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_sentencepiece():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    ids = tok.encode("hello world", add_special=False)
    assert stream(tok, ids) == ["hello", " world", ""]  # the added leading space is dropped once
    ids = tok.encode("naïve 🦙", add_special=False)  # byte fallback: <0xC3><0xAF> and four bytes for the llama
    deltas = stream(tok, ids)
    assert "".join(deltas) == "naïve 🦙" == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    ids = [BOS, SP["▁hello"], EOS]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "<s> hello</s>"
    assert "".join(stream(tok, ids, skip_special=True)) == tok.decode(ids, skip_special=True) == "hello"


# ---- a SentencePiece (`llama`) vocabulary ----


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    meta = sentencepiece_meta(**{"tokenizer.chat_template": "{{ bos_token }}{{ messages[0].content }}"})
    path = tmp_path_factory.mktemp("sp") / "sp.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(SP["<unk>"])
    writer.add_chat_template(meta["tokenizer.chat_template"])
    write_gguf(writer)
    return path


@pytest.fixture(scope="module")
def sentencepiece_hf(sentencepiece_gguf):
    return AutoTokenizer.from_pretrained(str(sentencepiece_gguf.parent), gguf_file=sentencepiece_gguf.name)


# Where llama.cpp and transformers agree: no leading spaces, no added tokens
AGREED = ["hello world", "the world!", "Hello café", "naïve 🦙", "in\tthe\nworld", "wor ld", "hellohello", ""]


@pytest.mark.parametrize("text", AGREED)
def test_sentencepiece_like_transformers(sentencepiece_gguf, sentencepiece_hf, text):
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(sentencepiece_gguf))
    ids = sentencepiece_hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special=False) == ids
    assert tok.encode(text) == sentencepiece_hf.encode(text)  # with BOS
    assert tok.decode(ids) == sentencepiece_hf.decode(ids) == text


# llama.cpp (llama-vocab.cpp, SPM): ' ' + text for every run of text at the start or after an added token,
# spaces -> '▁', then merges by score. transformers' Metaspace adds the '▁' only at the very start, and only
# when the text does not begin with a space, so these ids are worked out by hand.
BY_HAND = [
    ("  hello", True, ["▁", "▁", "▁hello"]),
    ("<s>hello", True, ["<s>", "▁hello"]),
    ("<s>hello", False, ["▁", "<0x3C>", "s", "<0x3E>", "he", "ll", "o"]),
    ("hello </s>", True, ["▁hello", "▁", "</s>"]),
    ("hello <tool> world", False, ["▁hello", "▁", "<tool>", "▁", "▁world"]),  # user-defined: always parsed
    ("Hi!", False, ["▁", "<0x48>", "i", "!"]),
]


@pytest.mark.parametrize(("text", "parse_special", "pieces"), BY_HAND)
def test_sentencepiece_llama_cpp_rules(text, parse_special, pieces):
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert tok.encode(text, add_special=False, parse_special=parse_special) == [SP[p] for p in pieces]


def test_sentencepiece_specials():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_meta())
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (BOS, EOS, True, False)  # llama.cpp's defaults
    assert tok.stop_ids == {EOS}
    assert tok.encode("") == [BOS]
    no_bos = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("hello") == [SP["▁hello"]]
    no_prefix = Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert no_prefix.encode("hello world", add_special=False) == [SP["he"], SP["ll"], SP["o"], SP["▁world"]]
    assert no_prefix.decode([SP["▁world"]]) == " world"  # no prefix was added, so none is dropped


# ---- byte-level pre-types (regexes of llama.cpp's src/llama-vocab.cpp) on a tiny vocabulary ----

BYTE_LEVEL_TEXTS = ["1234 12345 1", "IT'S it's hi'S", "hi   hi\n\nhi", "  hi!\n", "hi !!\n\n\n  \t1"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_pre_types_like_transformers(pre, tmp_path):
    path = tmp_path / f"{pre}.gguf"
    write_byte_level_gguf(path, byte_level_meta(pre))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(path))
    for text in BYTE_LEVEL_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special=False) == ids
        assert tok.decode(ids) == text


def test_llama3_takes_whole_vocabulary_words():
    # llama.cpp sets ignore_merges for llama-bpe: a pre-token found in the vocabulary is one token, even when no
    # merge leads to it; other pre-types build it from merges (here: none, so bytes)
    tokens = [*BYTE_LEVEL_TOKENS, "hello"]
    meta = byte_level_meta(
        "llama-bpe", **{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(tokens)}
    )
    assert Tokenizer.from_gguf_metadata(meta).encode("hello", add_special=False) == [len(BYTE_LEVEL_TOKENS)]
    meta["tokenizer.ggml.pre"] = "gpt-2"
    assert Tokenizer.from_gguf_metadata(meta).encode("hello", add_special=False) == [
        BYTE_LEVEL_TOKENS.index(c) for c in "hello"
    ]


def test_llama3_adds_bos_by_default():
    meta = byte_level_meta("llama-bpe", **{"tokenizer.ggml.bos_token_id": 5})
    assert Tokenizer.from_gguf_metadata(meta).encode("hi") == [5, BYTE_LEVEL_TOKENS.index("hi")]
    meta["tokenizer.ggml.add_bos_token"] = False
    assert Tokenizer.from_gguf_metadata(meta).encode("hi") == [BYTE_LEVEL_TOKENS.index("hi")]


# ---- a byte-level vocabulary with ChatML control tokens and the default model's template ----


@pytest.fixture(scope="module")
def chatml_gguf(tmp_path_factory, smollm_meta) -> Path:
    tokens = [*BYTE_LEVEL_TOKENS, "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    meta = byte_level_meta(
        "llama-bpe",
        **{
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(BYTE_LEVEL_TOKENS) + [3, 3, 3],
            "tokenizer.ggml.bos_token_id": tokens.index("<|im_start|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.chat_template": smollm_meta["tokenizer.chat_template"],
        },
    )
    path = tmp_path_factory.mktemp("chatml") / "chatml.gguf"
    write_byte_level_gguf(path, meta)
    return path


@pytest.fixture(scope="module")
def chatml_hf(chatml_gguf):
    return AutoTokenizer.from_pretrained(str(chatml_gguf.parent), gguf_file=chatml_gguf.name)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_prompt_ids_match_transformers(chatml_gguf, chatml_hf, messages):
    tok = Tokenizer.from_gguf_metadata(gguf_metadata(chatml_gguf))
    expected = chatml_hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.encode_chat(messages) == expected


# ---- Hugging Face folders (tokenizer.json), saved by transformers ----


def test_hf_dir_byte_level(chatml_hf, tmp_path):
    chatml_hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (chatml_hf.bos_token_id, chatml_hf.eos_token_id)
    assert tok.stop_ids >= {chatml_hf.eos_token_id, 5, 7}
    for text in [*BYTE_LEVEL_TEXTS, *(case["text"] for case in VECTORS)]:
        ids = chatml_hf.encode(text)
        assert tok.encode(text, parse_special=True) == ids
        assert tok.decode(ids) == chatml_hf.decode(ids)
        assert tok.decode(ids, skip_special=True) == chatml_hf.decode(ids, skip_special_tokens=True)
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages) == chatml_hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_hf_dir_sentencepiece(sentencepiece_hf, tmp_path):
    sentencepiece_hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (BOS, EOS, True)
    for text in [*AGREED, "  hello", "<s>hello", "hello <tool> world"]:
        ids = sentencepiece_hf.encode(text)
        assert tok.encode(text, parse_special=True) == ids
        assert tok.decode(ids) == sentencepiece_hf.decode(ids)
        assert tok.decode(ids, skip_special=True) == sentencepiece_hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello"}]  # the template writes BOS: it must not come twice
    expected = sentencepiece_hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert tok.encode_chat(messages) == expected["input_ids"]


# ---- bad input ----


def test_unknown_tokenizer_model():
    with pytest.raises(ModelFormatError, match="'t5'"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.model": "t5"}))


def test_unknown_pre_type(smollm_meta):
    with pytest.raises(ModelFormatError, match="'deepseek-coder'"):
        Tokenizer.from_gguf_metadata(dict(smollm_meta, **{"tokenizer.ggml.pre": "deepseek-coder"}))


def test_missing_or_inconsistent_vocabulary(tmp_path):
    with pytest.raises(ModelFormatError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelFormatError, match="token_type"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.token_type": [1, 2]}))
    with pytest.raises(ModelFormatError, match="bos_token_id"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.bos_token_id": 10_000}))
    with pytest.raises(ModelFormatError, match="scores"):
        Tokenizer.from_gguf_metadata(sentencepiece_meta(**{"tokenizer.ggml.scores": None}))
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("text", ["caf\udce9", "\ud800 hi", "ok \udfff"])
def test_text_that_is_not_unicode_is_refused(smollm, text):
    """A lone surrogate (an undecodable byte kept by surrogateescape, or JSON's "\\ud800") made the tokenizers
    library raise TypeError, which ended the engine process that `llamaterm serve` runs on."""
    with pytest.raises(RequestError, match="not valid Unicode"):
        smollm.encode(text)
    with pytest.raises(RequestError, match="not valid Unicode"):
        smollm.encode_chat([{"role": "user", "content": text}])


# ---- which chat template a Hugging Face folder ships: the engine and `llamaterm info` ask the same place ----


@pytest.mark.parametrize(
    "files",
    [
        {"tokenizer_config.json": "C"},
        {"tokenizer_config.json": "C", "chat_template.json": "J"},
        {"tokenizer_config.json": "C", "chat_template.jinja": "K", "chat_template.json": "J"},
        {"tokenizer_config.json": [("tool_use", "T"), ("default", "D")]},
    ],
)
def test_a_folder_s_chat_template_as_transformers_picks_it(tmp_path, files):
    """tokenizer.py once took only a named template called "default" while `llamaterm info` fell back to the
    first, and neither read chat_template.json. Now both ask hf_files.chat_template_source, which picks what
    transformers' AutoTokenizer picks; rendered here against transformers' own apply_chat_template."""
    write_dense(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    body = lambda mark: mark + "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    for name, template in files.items():
        if name == "tokenizer_config.json":
            config["chat_template"] = (
                body(template) if isinstance(template, str) else [{"name": n, "template": body(t)} for n, t in template]
            )
        elif name == "chat_template.json":
            (tmp_path / name).write_text(json.dumps({"chat_template": body(template)}))
        else:
            (tmp_path / name).write_text(body(template))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(messages, add_generation_prompt=False) == expected
    shown = read_checkpoint(tmp_path).chat_template
    assert shown[0] == expected[0] and shown == body(expected[0])  # `info` shows the template the engine uses


def test_a_processor_s_chat_template_json_is_read_where_there_is_no_other(tmp_path):
    """The Hub download fetches chat_template.json; a repo whose only template is there gets it, not ChatML."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J{{ messages[0]['content'] }}"}))
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "Jhi"
