"""The flags that shape a local engine, as ollama's, llama.cpp's and vLLM's users give them: --ctx (num_ctx, -c),
bounded by the model's own context and by memory; --gpu-memory (vLLM's --gpu-memory-utilization); --threads. Each
command runs as a user runs it, on the default model on the CPU."""

import json

import httpx2
import pytest

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.serving.engine_core import context_pool
from tests.support.cli import llamaterm
from tests.support.serve_support import served

QUESTION = "What is the capital of France?"


def run_json(*flags: str) -> dict:
    out = llamaterm("run", "--json", "--temperature", "0", *flags, QUESTION)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_ctx_bounds_a_conversation_and_not_past_the_model_s_own():
    short = run_json("--ctx", "40", "--max-tokens", "200")  # a 37-token prompt leaves room for 3
    assert short["prompt_tokens"] + short["generated_tokens"] <= 40 and short["finish_reason"] == "length"
    whole = run_json("--max-tokens", "200")
    assert whole["finish_reason"] == "stop"  # the same question, room to finish, finishes
    assert short["token_ids"] == whole["token_ids"][: len(short["token_ids"])]
    over = llamaterm("run", "--ctx", "100000", QUESTION)
    assert over.returncode == 1
    assert over.stderr == "llamaterm: --ctx 100000 is past the model's own context of 8192: give at most that\n"
    tight = llamaterm("run", "--ctx", "24", QUESTION)  # the prompt alone is 37 tokens
    assert tight.returncode == 1 and "the prompt is 37 tokens but the model's context holds 24" in tight.stderr
    pool = llamaterm("run", "--ctx", "4096", "--kv-tokens", "1024", QUESTION)
    assert pool.returncode == 1
    assert "--kv-tokens 1024 cannot hold one sequence of --ctx 4096: give at least as many KV tokens" in pool.stderr


def test_ctx_past_what_memory_holds_says_how_much_fits():
    config = EngineConfig(context_length=131072)
    with pytest.raises(LlamatermError) as refused:
        context_pool(config, kv_tokens=2048, kv_bytes=48 * 1024, free=4 * 10**9)
    assert str(refused.value) == "--ctx 131072 needs 6.44 GB of KV cache, and 4 GB are free: give at most --ctx 81380"
    assert context_pool(EngineConfig(context_length=4096), 2048, 48 * 1024, 4 * 10**9) == 4096  # the pool grows
    assert context_pool(EngineConfig(context_length=1024), 2048, 48 * 1024, 4 * 10**9) == 2048


@pytest.mark.slow
def test_serve_ctx_and_threads_and_the_pool_it_leaves():
    with served("--ctx", "512", "--threads", "1") as server:
        card = httpx2.get(f"{server.url}/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 512
        assert "context 512, KV cache " in server.log()
        (row,) = json.loads(llamaterm("ps", "--json").stdout)
        assert row["context"] == 512 and row["kv_tokens"] >= 512 and row["memory_bytes"] > 0
        body = {"model": card["id"], "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
        reply = httpx2.post(f"{server.url}/chat/completions", json=body, timeout=120).json()
    assert reply["choices"][0]["message"]["content"] == run_json()["text"]  # one thread: the same greedy answer


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, code, line",
    [
        (["--gpu-memory", "0.5"], 1, "--gpu-memory sets a GPU's share: on the CPU, --kv-tokens sizes the KV cache"),
        (["--gpu-memory", "1.5"], 2, "--gpu-memory 1.5 is not a share of the GPU's memory: give a number in (0, 1]"),
        (["--gpu-memory", "0"], 2, "--gpu-memory 0 is not a share of the GPU's memory"),
        (["--threads", "0"], 2, "Invalid value for '--threads'"),
        (["--ctx", "8"], 2, "Invalid value for '--ctx'"),
    ],
)
def test_flag_values_that_cannot_be_are_one_clear_line(flags, code, line):
    out = llamaterm("run", *flags, QUESTION)
    assert out.returncode == code and line in out.stderr and "Traceback" not in out.stderr, out.stderr
