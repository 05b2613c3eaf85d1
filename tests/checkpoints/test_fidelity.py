"""The default model against Hugging Face transformers (fp32, loaded from the same GGUF): next-token logits at
the end of chat prompts, and 64-token greedy continuations."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.store.model_store import default_model_path
from tests.support.engine_checks import our_last_logits

pytestmark = pytest.mark.slow  # the real default model beside transformers

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Explain what a paged KV cache is, in two sentences."},
    ],
]


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_model(EngineConfig(device="cpu"))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    out, past = [], None
    x = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(steps):
            r = model(input_ids=x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            token = int(r.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("chat", CHATS)
def test_logits_and_greedy_match_transformers(engine, hf_model, chat):
    ids = engine.tokenizer.encode_chat(chat)
    ours = our_last_logits(engine, ids)
    with torch.inference_mode():
        theirs = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
    span = (theirs.max() - theirs.min()).item()
    assert (ours - theirs).abs().max().item() <= 1e-3 * span
    _, handle = engine.generate(chat, SamplingParams(max_tokens=64, ignore_eos=True))
    assert handle.token_ids == hf_greedy(hf_model, ids, 64)


def test_run_answers_paris():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "llamaterm"), "run", "--temperature", "0", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
