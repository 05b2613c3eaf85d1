"""A small dense Llama checkpoint in the Hugging Face layout (config.json beside model.safetensors, random
weights), and the Hugging Face -> GGUF tensor names spelled out as the oracle for the loader's renaming. The
safetensors, compressed-tensors, tokenizer and hostile-file tests use them, and the fuzzer's seeds."""

import json

import torch
from safetensors.torch import save_file

# Hugging Face names -> GGUF names, spelled out as the oracle for the loader's renaming.
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    module, _, part = hf_name.rpartition(".")
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{part}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{part}"


# The checkpoint's shapes
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 128, 256, 4, 2, 2, 64
HEAD_DIM = HIDDEN // HEADS
LINEARS = {  # module -> (out, in)
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (FFN, HIDDEN),
    "mlp.up_proj": (FFN, HIDDEN),
    "mlp.down_proj": (HIDDEN, FFN),
}


def config_json(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        **extra,
    }


def write_dense(path, **config_extra):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
    }
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        for module, shape in LINEARS.items():
            tensors[f"model.layers.{i}.{module}.weight"] = torch.randn(shape, generator=gen)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config_json(**config_extra)))
    return tensors
