"""The model families llamaterm runs, by the names their files give them, and the variants refused by name.

Readers look a file's architecture up here first, so every "not supported" error lists the same families.
A family is named by its GGUF architecture (llama.cpp's name), which is also ModelConfig.arch.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    arch: str  # GGUF general.architecture
    hf_classes: tuple[str, ...]  # config.json architectures[0] (transformers' model classes)
    models: str  # the models people know it by
    hf_model_types: tuple[str, ...]  # config.json model_type


FAMILIES = (
    # llama.cpp writes Mistral models as "llama", and Mixtral as "llama" with experts
    Family(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM", "MixtralForCausalLM"),
        "Llama 2/3, Mistral, Ministral, Mixtral, SmolLM",
        ("llama", "mistral", "ministral", "mixtral"),
    ),
    Family("qwen2", ("Qwen2ForCausalLM",), "Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen", ("qwen2",)),
    Family("qwen3", ("Qwen3ForCausalLM",), "Qwen3 (dense)", ("qwen3",)),
    Family("phi3", ("Phi3ForCausalLM",), "Phi-3, Phi-3.5, Phi-4-mini", ("phi3",)),
    # the text model; llama.cpp's GGUFs of the larger, image-reading Gemma 3 models hold only it
    Family("gemma3", ("Gemma3ForCausalLM",), "Gemma 3 (text)", ("gemma3_text",)),
    # mixtures of experts
    Family("qwen3moe", ("Qwen3MoeForCausalLM",), "Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B", ("qwen3_moe",)),
    Family("qwen2moe", ("Qwen2MoeForCausalLM",), "Qwen1.5-MoE, Qwen2-57B-A14B", ("qwen2_moe",)),
    Family("gpt-oss", ("GptOssForCausalLM",), "gpt-oss-20b, gpt-oss-120b", ("gpt_oss",)),
)
GGUF_ARCHITECTURES = tuple(f.arch for f in FAMILIES)
HF_ARCHITECTURES = {cls: f.arch for f in FAMILIES for cls in f.hf_classes}

# Variants of the families above (or close kin) that do not run, under each name a file may give them
REFUSED = {
    "qwen3next": "Qwen3-Next (hybrid linear attention)",
    "Qwen3NextForCausalLM": "Qwen3-Next (hybrid linear attention)",
    "deepseek2": "DeepSeek V2/V3 (multi-head latent attention)",
    "DeepseekV3ForCausalLM": "DeepSeek V2/V3 (multi-head latent attention)",
    "phimoe": "Phi MoE (Phi-3.5-MoE, a mixture of experts)",
    "PhiMoEForCausalLM": "Phi MoE (Phi-3.5-MoE, a mixture of experts)",
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (run its GGUF, which holds the text model)",
}


def family_of(name: str | None) -> str | None:
    """The family a file's architecture name (GGUF's, a transformers class or model_type) runs as; None if none."""
    return next((f.arch for f in FAMILIES if name == f.arch or name in f.hf_classes + f.hf_model_types), None)


def supported_list() -> str:
    """One line naming what runs, for error messages."""
    return "; ".join(f"{f.models} ({f.arch})" for f in FAMILIES)


def not_supported(name: str | None) -> str:
    """Why an architecture outside FAMILIES does not load: a known variant by what it is, else by its name."""
    what = f"{REFUSED[name]}, {name!r}," if name in REFUSED else f"the architecture {name!r}"
    return f"{what} is not supported (llamaterm runs: {supported_list()})"
