"""Our engine's side of the model oracles: the logits of one prefill on a cache of its own, the greedy tokens of
a request, and the GPU's greedy choices checked against the fp32 CPU path's logits; and every KV block back in
the pool once an engine's requests have ended."""

import torch

from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.model import StepInput


def our_last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """A single prefill through the model, on a cache of our own (the engine's pool stays untouched)."""
    model, n = engine.core.model, len(ids)
    bs = 16
    nb = -(-n // bs)
    cache = model.allocate_kv_cache(nb, bs)
    step = StepInput(
        input_ids=torch.tensor(ids),
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(nb, dtype=torch.int32)[None],
        context_lens=torch.tensor([n]),
        query_start_loc=torch.tensor([0, n]),
        logits_indices=torch.tensor([n - 1]),
    )
    return model.forward(step, cache)[0]


def greedy(engine: Engine, ids: list[int], steps: int) -> list[int]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    handle = engine.submit(None, params, prompt_ids=ids)
    return [t for event in handle.events() for t in event.token_ids]


def logits_at(engine: Engine, ids: list[int], first: int) -> torch.Tensor:
    """Logits predicting ids[first + 1:] and the token after ids, from one forward pass over ids."""
    model, n, bs = engine.core.model, len(ids), 16
    nb = -(-n // bs)
    cache = model.allocate_kv_cache(nb, bs)
    dev = model.device
    step = StepInput(
        input_ids=torch.tensor(ids, device=dev),
        positions=torch.arange(n, device=dev),
        slot_mapping=torch.arange(n, device=dev),
        block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        context_lens=torch.tensor([n], device=dev),
        query_start_loc=torch.tensor([0, n], device=dev),
        logits_indices=torch.arange(first, n, device=dev),
    )
    return model.forward(step, cache).float().cpu()


# Where the fp32 reference's best two logits are closer than this, fp16 rounding may pick either (issue #12's
# fidelity bar); everywhere else the GPU must pick the reference's token.
MARGIN = 0.05


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return (top[0] - top[1]).item()


def assert_greedy_choices(cpu: Engine, prompt: list[int], generated: list[int]) -> None:
    """Every token the GPU picked greedily is the fp32 reference's argmax after the same prefix, wherever the
    reference's top-2 margin is above MARGIN."""
    ref = logits_at(cpu, prompt + generated[:-1], len(prompt) - 1)
    for t, tok in enumerate(generated):
        if top2_margin(ref[t]) > MARGIN:
            assert tok == int(ref[t].argmax()), (t, tok, int(ref[t].argmax()), top2_margin(ref[t]))


def assert_same_until_near_tie(cpu: Engine, prompt: list[int], generated: list[int], expected: list[int]) -> None:
    """The GPU's greedy continuation is the fp32 path's (`expected`) up to that path's first near-tie, from where
    the two may part."""
    ref = logits_at(cpu, prompt + expected[:-1], len(prompt) - 1)
    tie = next((t for t in range(len(expected)) if top2_margin(ref[t]) <= MARGIN), len(expected))
    assert generated[:tie] == expected[:tie], (tie, generated, expected)


def assert_every_block_back(engine: Engine) -> None:
    bm = engine.core.block_manager
    assert bm.num_free == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks.values())  # none freed twice (it would be -1)
    assert sorted(bm.free) == sorted(bm.blocks)  # every block used is in the free queue
