"""Model files: GGUF, safetensors and compressed-tensors loaders, tokenizers and chat templates, the model families and
the default model against transformers, hostile and fuzzed files."""
