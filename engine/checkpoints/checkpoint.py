"""What every checkpoint loader (GGUF, safetensors) returns: one in-memory form the model is built from."""

from dataclasses import dataclass
from pathlib import Path

import torch

from llamaterm.engine.checkpoints.config import ModelConfig
from llamaterm.kernels.qweight import QuantWeight


@dataclass
class Checkpoint:
    config: ModelConfig
    # Keyed by GGUF tensor names ("token_embd.weight", "blk.0.attn_q.weight", ...); q/k rows in Hugging Face
    # order (half-split NeoX RoPE). "output.weight" is absent when the embedding is tied.
    tensors: dict[str, torch.Tensor | QuantWeight]
    metadata: dict[str, object]
    path: Path
