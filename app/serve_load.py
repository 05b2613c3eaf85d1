"""The load behind `llamaterm bench --serve [URL]`: N streaming clients of the official `openai` client over several
processes, each a closed loop of streamed chat completions from a start time all share; tok/s from the usage of the
requests that ended inside the window, TTFT of those that started inside it, and every error. openai, httpx2 and the
engine load only inside the functions.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.workload import PromptMix, chat_message

START_TIMEOUT_S = 600  # loading a large model (and compiling its kernels) takes minutes
STOP_TIMEOUT_S = 30
READY_TIMEOUT_S = 120  # a client process imports openai and builds its client
REQUEST_TIMEOUT_S = 600  # between two chunks; a long prompt queued behind a full batch waits its turn
CONNECT_TIMEOUT_S = 30
STANDARD = {"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"}  # openai's own arguments
NO_OPENAI = "llamaterm bench --serve drives the server with the official openai client: pip install openai"


class Record(NamedTuple):
    """One request, its times from time.time()."""

    start: float
    first: float | None  # the first chunk with content
    end: float
    tokens: int | None  # completion_tokens of the usage chunk
    error: str | None


@dataclass(frozen=True)
class Job:
    """What one client process runs."""

    url: str
    model: str
    api_key: str | None
    clients: int
    first_client: int  # its clients' numbers, for their random streams
    seed: int  # this run's: prompts differ from any earlier run's, which a server may still hold in its cache
    sampling: dict
    prompts: PromptMix


def run_serve_load(
    url: str | None,
    *,
    model: str | None,
    device: str | None,
    clients: int,
    processes: int,
    warmup_s: float,
    window_s: float,
    sampling: dict,
    prompts: PromptMix,
    api_key: str | None = None,
    ctx: int | None = None,
) -> dict:
    """Drive the server at `url` (None: a `llamaterm serve` started here on a free port, stopped at the end) with
    `clients` streaming clients over `processes` processes for warmup_s + window_s; the result's figures are of
    the window. An unreachable `url` raises LlamatermError (from its GET /models)."""
    try:
        import openai  # noqa: F401  (the client processes use it)
    except ImportError:
        raise LlamatermError(NO_OPENAI) from None
    if clients < 1 or processes < 1 or window_s <= 0 or warmup_s < 0:
        raise LlamatermError("give at least one client and one process, and a window longer than 0 s")
    with server(url, model, device, ctx) as base_url:
        model_id, base_url = served_model(base_url, None if url is None else model, api_key)
        jobs = split(base_url, model_id, api_key, clients, min(processes, clients), sampling, prompts)
        start, records = run_processes(jobs, warmup_s + window_s)
    return {
        "url": base_url,
        "model": model_id,
        "clients": clients,
        "processes": len(jobs),
        "warmup_s": warmup_s,
        "window_s": window_s,
        **summarize(records, start + warmup_s, start + warmup_s + window_s),
    }


def format_serve_load(result: dict) -> str:
    ttft = result["ttft_ms"]
    ms = " ".join(f"{k} {'-' if ttft[k] is None else f'{ttft[k]:.1f}'}" for k in ("p50", "p99", "max"))
    lines = [
        f"{result['model']} at {result['url']}",
        f"{result['clients']} streaming clients over {result['processes']} processes, "
        f"{result['window_s']:g} s window after {result.get('warmup_s', 0):g} s warm-up",
        f"{result['tok_s']:.1f} tok/s | TTFT ms {ms} | {result['requests']} requests | {result['errors']} errors",
    ]
    return "\n".join(lines + [f"  error: {e}" for e in result["error_samples"]])


# ---- the server ----


@contextmanager
def server(url: str | None, model: str | None, device: str | None, ctx: int | None = None) -> Iterator[str]:
    """`url` as it is, or a `llamaterm serve` of `model` on `device` (with a context of `ctx` tokens, if given) for
    the block's length."""
    if url is not None:
        yield url
        return
    port = free_port()
    command = [sys.executable, "-m", "llamaterm.app", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--model", model] if model else []
    command += ["--device", device] if device else []
    command += ["--ctx", str(ctx)] if ctx else []
    # stderr to a file, not a pipe: a pipe nobody reads during the run would fill and stall the server
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_healthy(process, f"http://127.0.0.1:{port}", log)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop(process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, root: str, log) -> None:
    import httpx2

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx2.get(f"{root}/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass  # not listening yet
        if process.poll() is not None:
            raise LlamatermError(f"llamaterm serve exited ({process.returncode}) before it served: {tail(log)}")
        if time.monotonic() > deadline:
            raise LlamatermError(f"llamaterm serve did not answer /health in {START_TIMEOUT_S} s: {tail(log)}")
        time.sleep(0.2)


def tail(log, chars: int = 2000) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-chars:].strip() or "(nothing on its stderr)"


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, on which the server stops its engine too; a kill if it has not gone in STOP_TIMEOUT_S."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def served_model(url: str, model: str | None, api_key: str | None) -> tuple[str, str]:
    """(model id, base URL) from the server's GET /models, with the checks and messages of `--server`."""
    from llamaterm.app.remote import RemoteEngine

    with RemoteEngine(url, model, api_key) as remote:
        return remote.model_name, remote.base_url


# ---- the client processes ----


def split(url, model, api_key, clients: int, processes: int, sampling: dict, prompts: PromptMix) -> list[Job]:
    """The clients dealt over the processes, the remainder one each to the first."""
    seed = random.randrange(2**32)
    counts = [clients // processes + (i < clients % processes) for i in range(processes)]
    firsts = [sum(counts[:i]) for i in range(processes)]
    return [
        Job(url, model, api_key, n, first, seed, sampling, prompts) for n, first in zip(counts, firsts, strict=True)
    ]


def run_processes(jobs: list[Job], duration_s: float) -> tuple[float, list[Record]]:
    """(start, every record): the start is taken once every process is ready, so their start-up (spawn, importing
    openai) falls outside the warm-up and the window."""
    context = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads
    out, go = context.Queue(), context.Queue()
    procs = [context.Process(target=client_process, args=(job, out, go), daemon=True) for job in jobs]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            receive(out, procs, READY_TIMEOUT_S)
        start = time.time()
        for _ in procs:
            go.put(start + duration_s)
        # the last request of a client may take up to a read timeout per chunk: wait on the processes' health
        records = [r for _ in procs for r in receive(out, procs, None)]
        return start, records
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def receive(out, procs: list, timeout_s: float | None):
    """The next message from a client process; LlamatermError if one died or none answered in time."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise LlamatermError(f"a client process failed (exit code {dead[0]}): see its error above") from None
            if deadline is not None and time.monotonic() > deadline:
                raise LlamatermError(f"the client processes were not ready in {timeout_s:.0f} s") from None


def client_process(job: Job, out, go) -> None:
    """One process: `job.clients` asyncio tasks on one AsyncOpenAI; its records go back on `out`. The client is
    built before the process says it is ready: building it (an SSL context, an HTTP pool) can take seconds, which
    must not come out of the warm-up and the window."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to take: it ends these processes
    client = make_client(job)
    out.put(job.first_client)
    deadline = go.get()
    out.put(asyncio.run(run_clients(job, client, deadline)))


def make_client(job: Job):
    import httpx2
    import openai

    # as many connections as clients: a request waiting for a pooled connection would count as server latency
    limits = httpx2.Limits(max_connections=job.clients, max_keepalive_connections=job.clients)
    return openai.AsyncOpenAI(
        base_url=job.url,
        api_key=job.api_key or "none",
        max_retries=0,  # a retry would hide an error and count its time as latency
        timeout=httpx2.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )


async def run_clients(job: Job, client, deadline: float) -> list[Record]:
    records: list[Record] = []
    async with client:
        loops = [
            client_loop(client, job, random.Random(f"{job.seed}/{job.first_client + i}"), deadline, records)
            for i in range(job.clients)
        ]
        await asyncio.gather(*loops)
    if not records:  # never silent: a process that asked nothing says so
        late = time.time() - deadline
        records.append(
            Record(deadline, None, time.time(), None, f"no request was sent before the deadline ({late:.1f} s late)")
        )
    return records


async def client_loop(client, job: Job, rng: random.Random, deadline: float, records: list[Record]) -> None:
    """A closed loop: the next request goes when the last one has ended, until the deadline."""
    arguments = {k: v for k, v in job.sampling.items() if k in STANDARD}
    extra = {k: v for k, v in job.sampling.items() if k not in STANDARD} | {"ignore_eos": True}
    while time.time() < deadline:
        words, max_tokens = job.prompts.draw(rng)
        messages = chat_message(rng, words)
        records.append(await one_request(client, job.model, messages, max_tokens, arguments, extra))


async def one_request(client, model: str, messages, max_tokens: int, arguments: dict, extra: dict) -> Record:
    start, first, tokens, error = time.time(), None, None, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **arguments,
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.time()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if tokens is None:
            error = "the stream ended without its usage chunk"
    except Exception as e:  # an error is a measurement too: recorded, and the client asks again
        error = describe(e)
    return Record(start, first, time.time(), tokens, error)


def describe(e: Exception) -> str:
    """Short: the exception's kind, the HTTP status if any, and the server's own message where it sent one."""
    status = getattr(e, "status_code", None)  # openai.APIStatusError: the server answered with an error
    body = getattr(e, "body", None)  # openai.APIError: the server's error object, in a reply or in the stream
    message = body.get("message") if isinstance(body, dict) else None
    return f"{type(e).__name__}{f' {status}' if status else ''}: {message or str(e) or 'no message'}"[:200]


# ---- the figures ----


def summarize(records: list[Record], lo: float, hi: float) -> dict:
    """The window [lo, hi]'s figures."""
    ended = [r for r in records if r.error is None and lo <= r.end <= hi]
    ttft = sorted(1000 * (r.first - r.start) for r in records if r.error is None and r.first and lo <= r.start <= hi)
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(ended),
        "tok_s": sum(r.tokens or 0 for r in ended) / (hi - lo),  # an ended request without error has its count
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "max": ttft[-1] if ttft else None},
        "errors": len(errors),
        "error_samples": list(dict.fromkeys(errors))[:5],
    }


def percentile(ordered: list[float], p: float) -> float | None:
    """Nearest rank: a value that was measured, however few there are."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(len(ordered) * p / 100) - 1)]
