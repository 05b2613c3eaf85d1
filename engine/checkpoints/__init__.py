"""Checkpoints: GGUF and safetensors readers, model config, tokenizer and chat template; pure file formats.
May import llamaterm.kernels.qweight (the one quantized weight type) and nothing else of the engine's rooms."""
