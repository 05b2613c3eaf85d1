"""The load driver of `llamaterm bench --serve`: a `llamaterm serve` it starts on a tiny random model, driven by
streaming openai clients in two processes; an unreachable server; the chat prompt mix."""

import os
import random
import socket
import time
from pathlib import Path

import pytest

from llamaterm.app.serve_load import Record, format_serve_load, run_serve_load, summarize
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.workload import PromptMix
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow  # `llamaterm serve` and its load clients in subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_naming(text: str) -> list[str]:
    """The command lines of the processes on this machine that name `text` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


def test_a_started_server_under_load_and_gone_after(tmp_path):
    tiny = str(write_tiny_llama(tmp_path / "tiny.gguf", context_length=512))
    result = run_serve_load(
        None,
        model=tiny,
        device="cpu",
        clients=4,
        processes=2,
        warmup_s=0.5,
        window_s=2,
        sampling={"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1},
        prompts=PromptMix.fixed(8, (4, 8)),
    )
    assert result["errors"] == 0, result["error_samples"]
    assert result["model"] == "tiny" and result["clients"] == 4 and result["processes"] == 2
    assert result["requests"] > 0 and result["tok_s"] > 0
    ttft = result["ttft_ms"]
    assert 0 < ttft["p50"] <= ttft["p99"] <= ttft["max"]
    assert "tok/s" in format_serve_load(result)

    port = int(result["url"].split(":")[2].split("/")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the server let its port go: it has exited
    assert processes_naming(tiny) == []


def test_an_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(LlamatermError, match="cannot reach"):
        run_serve_load(
            url,
            model=None,
            device=None,
            clients=2,
            processes=1,
            warmup_s=0,
            window_s=1,
            sampling={"temperature": 0},
            prompts=PromptMix.fixed(8, (4, 8)),
        )


def test_the_chat_mix_has_its_proportions():
    rng = random.Random(0)
    draws = [PromptMix.chat().draw(rng) for _ in range(10_000)]
    words = [w for w, _ in draws]
    share = [sum(lo <= w <= hi for w in words) / len(words) for lo, hi in ((16, 255), (256, 1023), (1024, 2000))]
    assert share == pytest.approx([0.70, 0.25, 0.05], abs=0.02)
    assert all(32 <= t <= 512 for _, t in draws)
    assert min(t for _, t in draws) < 64 and max(t for _, t in draws) > 480  # the whole range, uniformly


def test_a_fixed_mix_is_fixed():
    rng = random.Random(0)
    assert {PromptMix.fixed(8, (4, 8)).draw(rng)[0] for _ in range(100)} == {8}
    assert {PromptMix.fixed(8, (4, 8)).draw(rng)[1] for _ in range(100)} == {4, 5, 6, 7, 8}


def test_the_figures_are_of_the_window():
    records = [
        Record(start=0.5, first=0.6, end=1.5, tokens=10, error=None),  # started in the warm-up: tokens, no TTFT
        Record(start=1.5, first=1.52, end=2.5, tokens=20, error=None),
        Record(start=2.5, first=2.51, end=3.5, tokens=40, error=None),  # ended after the window: TTFT, no tokens
        Record(start=1.6, first=None, end=1.7, tokens=None, error="APIConnectionError: Connection error."),
        Record(start=1.8, first=None, end=1.9, tokens=None, error="APIConnectionError: Connection error."),
    ]
    figures = summarize(records, lo=1.0, hi=3.0)
    assert figures["requests"] == 2 and figures["tok_s"] == 15
    assert figures["ttft_ms"]["p50"] == pytest.approx(10) and figures["ttft_ms"]["max"] == pytest.approx(20)
    assert figures["errors"] == 2 and figures["error_samples"] == ["APIConnectionError: Connection error."]


def test_a_client_process_that_sends_nothing_says_so():
    """A run once ended with no request and no error; a process whose clients never asked now reports it."""
    import asyncio

    from llamaterm.app.serve_load import Job, make_client, run_clients

    job = Job("http://127.0.0.1:9/v1", "m", None, 2, 0, 1, {}, PromptMix.fixed(4, (4, 4)))
    records = asyncio.run(run_clients(job, make_client(job), time.time() - 5))
    assert len(records) == 1 and "no request was sent before the deadline" in records[0].error
