"""Each sampled token's log-probability and likeliest alternatives (SamplingParams.logprobs) against transformers:
log-softmax of its fp32 logits over the same tokens, for a tiny random Llama. The model's own distribution, whatever
the request's bias, penalties, temperature and filters; in the engine and through the engine process."""

import pytest
import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.process import EngineProcess
from tests.support.family_oracle import byte_level_bpe, hf_logits, save_tiny_model

transformers = pytest.importorskip("transformers")

VOCAB = 384
PROMPTS = [[5, 17, 200, 33, 99, 1, 250, 7, 64, 128, 300, 12, 45], [9, 8, 7, 6, 5]]
PARAMS = [
    SamplingParams(max_tokens=10, logprobs=5, ignore_eos=True),  # greedy
    SamplingParams(
        max_tokens=10,
        logprobs=20,
        temperature=1.2,
        top_k=40,
        repetition_penalty=1.3,
        logit_bias=((5, 3.0), (6, -100.0)),
        seed=3,
        ignore_eos=True,
    ),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logprobs") / "hf"
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = save_tiny_model(transformers.LlamaForCausalLM, config, folder)
    byte_level_bpe(folder, VOCAB, ["<|im_start|>", "<|im_end|>"])
    return model, folder


@pytest.mark.parametrize(
    "where, device",
    [
        ("engine", "cpu"),
        pytest.param("process", "cpu", marks=pytest.mark.slow),
        pytest.param("engine", "cuda", marks=pytest.mark.cuda),  # fp16 weights: to 1e-2
    ],
)
def test_logprobs_are_the_models_log_softmax(tiny, where, device):
    model, folder = tiny
    config = EngineConfig(model=str(folder), device=device, kv_tokens=1024)
    engine = Engine.from_model(config) if where == "engine" else EngineProcess(config)
    tol = 1e-3 if device == "cpu" else 1e-2
    try:
        handles = [engine.submit(None, p, prompt_ids=ids) for ids, p in zip(PROMPTS, PARAMS, strict=True)]
        for ids, p, handle in zip(PROMPTS, PARAMS, handles, strict=True):
            events = list(handle.events())
            tokens = [t for e in events for t in e.token_ids]
            logprobs = [lp for e in events for lp in e.logprobs]
            assert len(tokens) == len(logprobs) == p.max_tokens
            for i, lp in enumerate(logprobs):
                want = torch.log_softmax(hf_logits(model, ids + tokens[:i])[-1], -1)
                assert lp.token_id == tokens[i] and abs(lp.logprob - want[tokens[i]]) <= tol
                top_ids, top_values = [t for t, _ in lp.top], torch.tensor([v for _, v in lp.top])
                assert torch.allclose(top_values, want.topk(p.logprobs).values, atol=tol)
                assert torch.allclose(want[top_ids], top_values, atol=tol)
    finally:
        engine.shutdown()


def test_a_request_that_asks_none_gets_none(tiny):
    _, folder = tiny
    with Engine.from_model(EngineConfig(model=str(folder), device="cpu", kv_tokens=1024)) as engine:
        events = list(engine.submit(None, SamplingParams(max_tokens=4), prompt_ids=PROMPTS[0]).events())
        assert all(e.logprobs == () for e in events)
        zero = list(engine.submit(None, SamplingParams(max_tokens=4, logprobs=0), prompt_ids=PROMPTS[0]).events())
        assert [len(lp.top) for e in zero for lp in e.logprobs] == [0] * 4
