"""Raw prompts read as vLLM and llama.cpp's server read them (issue #24, item 6): special-token text such as
'<|im_start|>' becomes those tokens, unless the caller asks for the literal reading. The oracles: llama.cpp's ids
for the default model with and without special parsing (tests/data/smollm2_tokenizer.json), transformers'
tokenizer of the same GGUF (which parses special tokens unless told split_special_tokens), and llama.cpp's
SentencePiece rule worked out by hand (a text fragment after a special token takes the space prefix)."""

import json

import pytest
from transformers import AutoTokenizer

from llamaterm.app.remote import request_body
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.prompt import PromptEncoder
from llamaterm.engine.store.loader import load_tokenizer
from llamaterm.engine.store.model_store import resolve_model
from tests.support import DATA
from tests.support.cli import llamaterm
from tests.support.tokenizer_files import BOS, SP, sentencepiece_meta

VECTOR = next(  # '<|im_start|>user\nHi<|im_end|>': 5 ids parsed, 17 as text
    case
    for case in json.loads((DATA / "smollm2_tokenizer.json").read_text())["cases"]
    if case["ids"] != case["ids_parse_special"]
)
CHATML = (  # a whole ChatML conversation as a client of /v1/completions writes it
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one short sentence, and then name one famous "
    "landmark of that city and say in which century it was built.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def default_model() -> PromptEncoder:
    return PromptEncoder(load_tokenizer(None))


def test_special_token_text_is_read_as_llama_cpp_reads_it(default_model):
    assert default_model.encode(VECTOR["text"], raw=True) == (VECTOR["ids_parse_special"], False)
    assert default_model.encode(VECTOR["text"], raw=True, parse_special=False) == (VECTOR["ids"], False)


def test_chat_messages_stay_text_whatever_parse_special_says(default_model):
    message = [{"role": "user", "content": VECTOR["text"]}]
    assert default_model.encode(message, parse_special=True) == default_model.encode(message, parse_special=False)
    ids, _ = default_model.encode(message)
    assert len(ids) > len(VECTOR["ids"])  # the content's 17 text tokens are in it, not its 5 parsed ones


@pytest.mark.slow
def test_a_chatml_prompt_is_the_ids_transformers_gives(default_model):
    path = resolve_model(None)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    parsed = hf(CHATML, add_special_tokens=False).input_ids
    literal = hf(CHATML, add_special_tokens=False, split_special_tokens=True).input_ids
    assert default_model.encode(CHATML, raw=True)[0] == parsed
    assert default_model.encode(CHATML, raw=True, parse_special=False)[0] == literal
    assert parsed.count(hf.convert_tokens_to_ids("<|im_start|>")) == 3 and len(literal) > len(parsed)


def test_a_prompt_that_writes_its_bos_gets_one():
    """The model adds BOS; a prompt that begins with the BOS token's text gets no second one (llama.cpp's server
    keeps both and warns)."""
    encoder = PromptEncoder(Tokenizer.from_gguf_metadata(sentencepiece_meta()))
    assert encoder.encode("<s>hello", raw=True)[0] == [BOS, SP["▁hello"]]
    assert encoder.encode("hello", raw=True)[0] == [BOS, SP["▁hello"]]
    literal = encoder.encode("<s>hello", raw=True, parse_special=False)[0]
    assert literal[0] == BOS and BOS not in literal[1:]


@pytest.mark.slow
def test_run_raw_parses_special_tokens_unless_told_not_to():
    def prompt_tokens(*flags: str) -> int:
        out = llamaterm("run", "--raw", "--json", "--temperature", "0", "--max-tokens", "1", *flags, VECTOR["text"])
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["prompt_tokens"]

    assert prompt_tokens() == len(VECTOR["ids_parse_special"])
    assert prompt_tokens("--no-parse-special") == len(VECTOR["ids"])


def test_a_remote_engine_asks_the_server_for_the_literal_reading_only_when_told():
    """llama.cpp's server and llamaterm serve read parse_special; other servers never see the field unless asked."""
    _, parsed = request_body("m", VECTOR["text"], SamplingParams(), raw=True)
    _, literal = request_body("m", VECTOR["text"], SamplingParams(), raw=True, parse_special=False)
    assert "parse_special" not in parsed and literal["parse_special"] is False
