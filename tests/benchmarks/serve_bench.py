"""Does HTTP cost throughput? The same closed-loop load, once submitted to the engine directly and once through
`llamaterm serve` on loopback, each for a bounded time:

    python -m tests.benchmarks.serve_bench --clients 64 --seconds 40 --max-tokens 16 --device cpu

Each of N clients asks, waits for the whole streamed reply, and asks again until the time is up; then every
client finishes the request it has in flight. Aggregate tok/s = tokens generated / (last finish - start), both
ways counted the same: from the engine's request stats directly, from the usage chunk through the server (the
server's own count of the same thing). Every request ignores EOS, so each makes exactly --max-tokens tokens.
Through the server it also counts errors, the CPU time of the server's own process (HTTP, JSON, the event
pump; the engine's child process not included) and of the clients, and once the load stops, the KV blocks and
requests still held.
Direct and served runs take turns, so a neighbour's load on a shared machine falls on both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import httpx2

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.process import EngineProcess
from tests.support.serve_support import llamaterm_serve, metrics

TOPICS = ["the sea", "a lighthouse", "bread", "a comet", "trains", "a garden", "winter", "a violin"]


def question(client: int, turn: int) -> list[dict]:
    topic = TOPICS[(client + turn) % len(TOPICS)]
    return [{"role": "user", "content": f"Client {client}, turn {turn}: write a short story about {topic}."}]


def direct(engine: EngineProcess, clients: int, seconds: float, max_tokens: int) -> tuple[float, int]:
    """(tok/s, requests) with the load submitted to the engine itself, a thread per client."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens, finishes, requests = [], [], []
    start = time.perf_counter()
    deadline = start + seconds

    def client(i: int) -> None:
        turn = 0
        while time.perf_counter() < deadline:
            handle = engine.submit(question(i, turn), params)
            last = list(handle.events())[-1]
            assert last.error is None, last.error
            tokens.append(handle.stats().generated_tokens)
            finishes.append(time.perf_counter())
            turn += 1
        requests.append(turn)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (max(finishes) - start), sum(requests)


async def through_server(
    url: str, model: str, clients: int, seconds: float, max_tokens: int
) -> tuple[float, int, list[str]]:
    """(tok/s, requests, errors) with the load sent as streamed chat completions, a connection per client."""
    tokens, finishes, errors, requests = [], [], [], []
    start = time.perf_counter()
    deadline = start + seconds

    async def client(http: httpx2.AsyncClient, i: int) -> None:
        turn = 0
        while time.perf_counter() < deadline:
            body = {
                "model": model,
                "messages": question(i, turn),
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            used = None
            async with http.stream("POST", "/chat/completions", json=body) as reply:
                if reply.status_code != 200:
                    errors.append(f"HTTP {reply.status_code}")
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"usage": {' in line:
                        used = json.loads(line[6:])["usage"]["completion_tokens"]
                    elif line.startswith('data: {"error"'):
                        errors.append(line)
            if used is None:
                errors.append("a stream ended without its usage")
            else:
                tokens.append(used)
                finishes.append(time.perf_counter())
            turn += 1
        requests.append(turn)

    limits = httpx2.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=httpx2.Timeout(30, read=None)) as http:
        await asyncio.gather(*(client(http, i) for i in range(clients)))
    return sum(tokens) / (max(finishes) - start), sum(requests), errors


def cpu_seconds(port: int) -> float:
    """CPU time so far of the `llamaterm serve` process listening on `port` (Linux /proc), the engine's child
    process not included: what the HTTP side costs."""
    for entry in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            if b"serve" in cmdline and str(port).encode() in cmdline:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            continue
    raise LookupError(f"no llamaterm serve process on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="direct and served runs, taken in turns")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    load = (args.clients, args.seconds, args.max_tokens)
    device = ["--device", args.device] if args.device else []

    with EngineProcess(EngineConfig(device=args.device)) as engine, llamaterm_serve(*device) as url:
        port = int(url.split(":")[2].split("/")[0])
        model = engine.model_name
        direct(engine, 8, 3, 4)  # warm-ups
        asyncio.run(through_server(url, model, 8, 3, 4))
        print(
            f"{model} on {engine.device}, {args.clients} clients x {args.seconds:.0f} s, {args.max_tokens} "
            "tokens a request; tok/s (requests)"
        )
        rates: dict[str, list[float]] = {"direct": [], "served": []}
        for turn in range(1, args.rounds + 1):
            rate, requests = direct(engine, *load)
            rates["direct"].append(rate)
            cpu_before, client_before, wall = cpu_seconds(port), time.process_time(), time.perf_counter()
            served, served_requests, errors = asyncio.run(through_server(url, model, *load))
            wall = time.perf_counter() - wall
            http_cpu, client_cpu = (cpu_seconds(port) - cpu_before) / wall, (time.process_time() - client_before) / wall
            rates["served"].append(served)
            time.sleep(1)  # the engine process forwards its stats every tick
            after = metrics(url)
            print(
                f"round {turn}: engine directly {rate:7.1f} ({requests}) | through llamaterm serve {served:7.1f} "
                f"({served_requests}), {served / rate:.1%} | CPU: server {http_cpu:.1%}, clients "
                f"{client_cpu:.1%} of a core | errors "
                f"{len(errors)}{' ' + errors[0] if errors else ''} | after: "
                f"{after['llamaterm_requests_running']:.0f} running, {after['llamaterm_kv_blocks_used']:.0f} KV "
                "blocks held"
            )
    direct_median, served_median = (statistics.median(rates[k]) for k in ("direct", "served"))
    print(
        f"median: engine directly {direct_median:.1f}, through llamaterm serve {served_median:.1f} tok/s: "
        f"{served_median / direct_median:.1%}"
    )


if __name__ == "__main__":
    main()
