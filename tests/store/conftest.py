"""The store room's fixtures: a Hub look-alike per test (tests/support/hub_server.py) with HF_ENDPOINT pointing at
it and LLAMATERM_HOME / HF_HOME in the test's tmp dir, so the real store and the real Hub are never touched; and
tiny GGUF files in the real format, and a tiny safetensors model folder, to serve (or to pull from a path)."""

import json

import pytest

from tests.support.hub_server import HubServer
from tests.support.tiny_models import write_tiny_llama

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

# The tiny models' shapes (tests/support/tiny_models.py defaults), for counting their parameters independently.
HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 64, 4, 2, 128, 2


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, bytes]:
    """GGUF files in the real format, by name. Written before any test points LLAMATERM_HOME elsewhere:
    the runnable model copies its tokenizer from the installed default model."""
    d = tmp_path_factory.mktemp("models")
    out = {"llama": write_tiny_llama(d / "llama.gguf", qtype="Q4_K").read_bytes()}
    for qtype in ("Q8_0", "Q4_0", "F16"):
        out[qtype] = write_tiny_llama(d / f"{qtype}.gguf", qtype=qtype, vocab_from=None).read_bytes()
    first = write_tiny_llama(d / "split.gguf", qtype="Q8_0", vocab_from=None, split_max_tensors=7)
    out |= {f"split{i}": first.with_name(f"split-0000{i}-of-00003.gguf").read_bytes() for i in (1, 2, 3)}
    return out


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("LLAMATERM_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no real token, no real cache
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        yield server


@pytest.fixture(scope="session")
def safetensors_repo(tmp_path_factory) -> dict[str, bytes]:
    """A tiny Llama as a Hugging Face repo: config.json, a byte-level BPE tokenizer.json, model.safetensors."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    d = tmp_path_factory.mktemp("safetensors")
    byte_tokens = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte, no merges
    tokenizer = Tokenizer(BPE(vocab={c: i for i, c in enumerate(byte_tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(d / "tokenizer.json"))
    head_dim, gen = HIDDEN // HEADS, torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (256, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
            layer + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            layer + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            layer + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    save_file({name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}, d / "w")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    return {
        "config.json": json.dumps(config).encode(),
        "generation_config.json": b"{}",
        "tokenizer.json": (d / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": json.dumps({"chat_template": CHAT_TEMPLATE}).encode(),
        "model.safetensors": (d / "w").read_bytes(),
    }
