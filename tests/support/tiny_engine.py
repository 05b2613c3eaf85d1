"""A tiny random Llama with a real vocabulary (the tests' byte-level one), and engines on it on the CPU."""

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.gguf import load_gguf
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import Model
from tests.support.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=2, context_length=512)
    ckpt = load_gguf(path)
    return ckpt, Tokenizer.from_gguf_metadata(ckpt.metadata)


def make_engine(tiny, **kwargs) -> Engine:
    ckpt, tokenizer = tiny
    model = Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32)
    return Engine(EngineCore(model, tokenizer, EngineConfig(**kwargs)))
