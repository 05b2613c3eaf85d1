"""The graph buckets (engine/serving/cuda_graph.py), checked on the CPU: every step the scheduler can make has a
bucket, and padding stays under one 64-row matmul tile up to 512 tokens and under 256 tokens above."""

import pytest

from llamaterm.engine.serving.cuda_graph import token_buckets


@pytest.mark.parametrize(("max_batch", "max_tokens"), [(64, 2048), (8, 256), (48, 2048), (64, 100), (256, 4096)])
def test_every_step_size_has_a_tight_bucket(max_batch, max_tokens):
    buckets = token_buckets(max_batch, max_tokens)
    assert buckets[-1] == max_tokens and max_batch in buckets or max_batch > max_tokens
    for t in range(1, max_tokens + 1):
        bucket = min(b for b in buckets if b >= t)
        assert min(bucket, max_batch) >= min(t, max_batch)  # room for every sequence of the step
        if t <= 64:
            assert bucket < 2 * t or bucket == t  # pure decode sizes: powers of two
        elif t <= 512:
            assert bucket - t < 64
        else:
            assert bucket - t < 256
