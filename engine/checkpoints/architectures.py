"""The model families llamaterm runs, by the names their files give them, and the variants refused by name.

Readers check a file's architecture here first, so every "not supported" error lists the same families.
"""

# GGUF general.architecture values (llama.cpp's names; it writes Mistral models as "llama")
GGUF_ARCHITECTURES = ("llama",)
# config.json architectures[0] values (transformers' model classes)
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM")


def supported_list() -> str:
    """One line naming what runs, for error messages."""
    return f"GGUF {', '.join(GGUF_ARCHITECTURES)}; Hugging Face {', '.join(HF_ARCHITECTURES)}"
