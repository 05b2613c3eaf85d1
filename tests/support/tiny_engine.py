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


class AloneReplies:
    """The oracle the engine's batching, preemption and drafting are held to: each request's reply, run alone on an
    engine of the given config. A greedy or seeded reply is a function of its request, so a request asked for again
    (the same requests under another test parameter) is answered from the replies kept."""

    def __init__(self, tiny):
        self.tiny = tiny
        self.engines: dict[tuple, Engine] = {}
        self.replies: dict[tuple, list[int]] = {}

    def __call__(self, requests, **config) -> list[list[int]]:
        settings = tuple(sorted(config.items()))
        if settings not in self.engines:
            self.engines[settings] = make_engine(self.tiny, **config)
        out = []
        for prompt, params in requests:
            key = (settings, tuple(prompt), params)
            if key not in self.replies:
                handle = self.engines[settings].submit(None, params, prompt_ids=prompt)
                list(handle.events())
                self.replies[key] = handle.token_ids
            out.append(list(self.replies[key]))
        return out

    def close(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


@pytest.fixture(scope="module")
def alone(tiny):
    oracle = AloneReplies(tiny)
    yield oracle
    oracle.close()
