"""Hostile and damaged model files: each is a one-line error that names the problem, never a traceback, a hang or
an allocation without bound. Loaders run under a memory cap (tests/support/capped.py) where the old code allocated
gigabytes."""

import json
import struct

import numpy as np
import pytest
from gguf.constants import GGUFValueType as V
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from llamaterm.engine.errors import ModelFormatError
from llamaterm.engine.store.loader import load_checkpoint
from tests.support.capped import llamaterm_capped, one_line_error, run_capped
from tests.support.fuzz import byte_level_tokenizer_json
from tests.support.safetensors_files import write_dense
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow  # the loaders and the CLI in capped child processes

# --- GGUF metadata of the wrong type ---------------------------------------------------------------------

WRONG_TYPES = {
    "tokenizer.ggml.bos_token_id": ("1", V.STRING),
    "tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY),
    "tokenizer.ggml.merges": ([1, 2, 3], V.ARRAY),
    "tokenizer.chat_template": (7, V.UINT32),
    "general.architecture": (["llama"], V.ARRAY),
    "llama.embedding_length": ("64", V.STRING),
    "split.count": ([1, 2], V.ARRAY),
}


@pytest.mark.parametrize("key", list(WRONG_TYPES) + ["tokenizer.chat_template[]"])
def test_gguf_metadata_of_the_wrong_type(tmp_path, key):
    typed = (["{{ x }}", "{{ y }}"], V.ARRAY) if key.endswith("[]") else WRONG_TYPES[key]
    key = key.removesuffix("[]")
    path = write_tiny_llama(tmp_path / "m.gguf", metadata={key: typed})
    with pytest.raises(ModelFormatError, match=f"{key} = .* is not (a|an) "):
        load_checkpoint(str(path))


def test_gguf_metadata_error_is_one_line_from_the_cli(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", metadata={"tokenizer.ggml.bos_token_id": ("1", V.STRING)})
    for command in (["tokenize", "--model", str(path), "hi"], ["run", "--model", str(path), "hi"]):
        out = llamaterm_capped(*command)
        assert out.returncode == 1 and one_line_error(out.stderr), out.stderr
        assert "tokenizer.ggml.bos_token_id" in out.stderr


def gguf_with_array(path, n: int):
    """A GGUF of one metadata key, an array of n uint8 values, and no tensors (the spec's layout, by hand)."""
    key = b"test.big_array"
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1))
        f.write(struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", V.ARRAY, V.UINT8, n))
        f.write(np.arange(n, dtype=np.uint8).tobytes())
    return path


def test_a_large_numeric_metadata_array_is_not_copied(tmp_path):
    # The array was a list of Python ints: 50 MB of uint8 cost 430 MB. Now it is a view of the mapped file.
    path = gguf_with_array(tmp_path / "big.gguf", 50_000_000)
    # resident memory now, not the peak: torch's import peaks higher than it stays, and hid the copy under it
    out = run_capped(
        "import resource, sys\n"
        "from llamaterm.engine.checkpoints.gguf import read_gguf_info\n"
        "resident = lambda: int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize()\n"
        "before = resident()\n"
        "values = read_gguf_info(sys.argv[1])['metadata']['test.big_array']\n"
        "assert len(values) == 50_000_000 and values[257] == 1\n"
        "print((resident() - before) >> 20)",
        str(path),
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 25, f"reading the metadata took {out.stdout.strip()} MB more"


# --- config.json, the safetensors index and tokenizer.json ----------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("hidden_size", "abc", "hidden_size = 'abc' is not a positive integer"),
        ("num_attention_heads", 0, "num_attention_heads = 0 is not a positive integer"),
        ("num_hidden_layers", 1e8, "num_hidden_layers = 100000000.0 is not a positive integer"),
        ("num_hidden_layers", 1000, "num_hidden_layers = 1000, but the checkpoint holds only"),
        ("num_hidden_layers", 100_000_000, "num_hidden_layers = 100000000 is beyond any model's (at most 4096)"),
        ("rms_norm_eps", [1e-6], "rms_norm_eps = an array of 1 (float) is not a positive number"),
        ("rope_scaling", {"rope_type": "llama3", "factor": "8"}, "factor = '8' is not a positive number"),
        # past the checks, into the reading code: a traceback before (AttributeError, OverflowError)
        ("quantization_config", "gptq", "values llamaterm cannot read (AttributeError"),
        pytest.param("rms_norm_eps", 10**400, "values llamaterm cannot read (OverflowError", id="rms_norm_eps-10**400"),
        ("partial_rotary_factor", 1e308, "values llamaterm cannot read (OverflowError"),
    ],
)
def test_config_json_fields_of_the_wrong_type(tmp_path, field, value, words):
    write_dense(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = llamaterm_capped("run", "--model", str(tmp_path), "hi")  # segfaulted at 5 GB for 1e8 layers
    assert out.returncode == 1 and one_line_error(out.stderr), out.stderr
    assert words in out.stderr


def test_sizes_past_any_model_s_are_refused_before_their_tables_are_made(tmp_path):
    """A table of a factor per frequency (linear RoPE) or a flag per layer (a sliding window's pattern) was made
    before the size was checked: gigabytes, or a MemoryError."""
    write_dense(tmp_path, head_dim=10**12, rope_scaling={"type": "linear", "factor": 2.0})
    out = llamaterm_capped("run", "--model", str(tmp_path), "hi")
    assert out.returncode == 1 and one_line_error(out.stderr), out.stderr
    assert "head_dim 1000000000000 is beyond any model's" in out.stderr
    window = {
        "llama.attention.sliding_window": (512, V.UINT32),
        "llama.attention.sliding_window_pattern": (2, V.UINT32),
    }
    path = write_tiny_llama(tmp_path / "m.gguf", metadata={"llama.block_count": (10**9, V.UINT64), **window})
    out = llamaterm_capped("run", "--model", str(path), "hi")
    assert out.returncode == 1 and one_line_error(out.stderr), out.stderr
    assert "llama.block_count = 1000000000 is beyond any model's (at most 4096)" in out.stderr


def test_an_index_pointing_outside_the_folder_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_dense(model)
    (model / "model.safetensors").rename(tmp_path / "outside.safetensors")
    names = json.loads(
        run_capped(
            "from safetensors import safe_open; import sys\n"
            "print(__import__('json').dumps(list(safe_open(sys.argv[1], 'pt').keys())))",
            str(tmp_path / "outside.safetensors"),
        ).stdout
    )
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "../outside.safetensors")}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="points outside the model folder"):
        load_checkpoint(str(model))


@pytest.mark.parametrize(
    "where, words",
    [
        ("vocab", "has id 2147483648, far beyond the 259 tokens"),  # the table of ids had 2**31 entries
        ("added_tokens", "is not in the vocabulary"),  # an IndexError
    ],
)
def test_tokenizer_json_ids_out_of_range(tmp_path, where, words):
    spec = byte_level_tokenizer_json()
    if where == "vocab":
        spec["model"]["vocab"]["zz"] = 2**31
    else:
        spec["added_tokens"][0]["id"] = 100_000
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    out = run_capped(
        "import sys\nfrom llamaterm.engine.checkpoints.tokenizer import Tokenizer\n"
        "from llamaterm.engine.errors import ModelFormatError\n"
        "try:\n    Tokenizer.from_hf_dir(sys.argv[1])\n"
        "except ModelFormatError as e:\n    print(e)",
        str(tmp_path),
    )
    assert out.returncode == 0 and words in out.stdout, out.stderr


@pytest.mark.parametrize(
    "header", [[], {"model.norm.weight": {"shape": [4], "data_offsets": [0, 16]}}], ids=["list", "no-dtype"]
)
def test_info_on_a_damaged_safetensors_header(tmp_path, header):
    write_dense(tmp_path)
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    out = llamaterm_capped("info", str(tmp_path))
    assert out.returncode == 1 and one_line_error(out.stderr), out.stderr
    assert "model.safetensors" in out.stderr and "header" in out.stderr


# --- chat templates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ 7**(7**9) }}", "'**' would make"),  # hung while jinja folded the constant
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran for more than"),
        ("{{ 'x'*300000000 }}", "'*' would make"),  # aborted the process
        ("{{ 9**99999 }}", "'**' would make"),  # a ValueError traceback from the compiler
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "'~' made a string",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "'+' would make",
        ),
        # one C call each, past any time limit: gigabytes (or the memory cap's MemoryError) before
        ("{{ 'x' | center(2000000000) }}", "center() would make"),
        ("{{ 'x'.ljust(2000000000) }}", "ljust() would make"),
        ("{{ '%2000000000s' % 'x' }}", "'%' would make"),
        ("{{ '%*s' % (2000000000, 'x') }}", "'%' would make"),
        ("{{ '%2000000000s' | format('x') }}", "format() would make"),
        ("{{ '{:>2000000000}'.format('x') }}", "format() would make"),
        ("{{ ('x' * 1000000) | replace('x', 'y' * 1000) }}", "replace() would make"),
        ("{{ ('x' * 1000000).replace('x', 'y' * 1000) }}", "replace() would make"),
        ("{{ range(100000) | join('x' * 100000) }}", "join() would make"),
        ("{{ ('x' * 100000).join(['a'] * 100000) }}", "join() would make"),
        ("{{ ('x' * 10000000) | join('y' * 10) }}", "join() would make"),
        ("{{ ('x\n' * 100000) | indent(100000) }}", "indent() would make"),
        ("{{ ('\t' * 1000000).expandtabs(100000) }}", "expandtabs() would make"),
        ("{{ ('x' * 1000000) | wordwrap(1, true, 'y' * 1000) }}", "wordwrap() would make"),
        ("{{ [1] | batch(2000000000, 'x') | list }}", "batch() would make"),
        ("{{ range(100000) | list | tojson(indent=1000) }}", "tojson()'s indent would make"),
        ("{{ ('&' * 10000000) | e | string | e }}", "e() would make"),  # 5x each time
    ],
)
def test_chat_templates_render_within_a_budget(template, words):
    out = run_capped(
        "import sys\nfrom llamaterm.engine.checkpoints.chat_template import ChatTemplate\n"
        "from llamaterm.engine.errors import ModelFormatError\n"
        "try:\n"
        "    ChatTemplate(sys.argv[1]).render([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True,"
        " bos_token='', eos_token='')\n"
        "except ModelFormatError as e:\n    print(e)",
        template,
        timeout=30,
    )
    assert out.returncode == 0 and words in out.stdout, out.stdout + out.stderr


def test_a_template_within_budget_still_renders():
    text = (
        "{{ 2**10 }} {{ 'ab'*3 }} {{ [1]*2 }} {{ 'a' ~ 'b' }} {{ 1 + 2 }} {{ 'ab'|center(6) }}|"
        "{{ 'a\nb'|indent(2) }}|{{ '%5.2f' % 3.14159 }}|{{ '%d' % 12345678901 }}|{{ '{} {}'.format(1, 'x') }}|"
        "{{ [1, 2]|join(', ') }}|{{ ', '.join(['a', 'b']) }}|{{ 'aXb'.replace('X', '--') }}|"
        "{{ 'a b c'|wordwrap(3) }}"
    )
    rendered = ChatTemplate(text).render([], add_generation_prompt=False, bos_token="", eos_token="")
    assert rendered == ImmutableSandboxedEnvironment().from_string(text).render()  # as jinja's own sandbox does
