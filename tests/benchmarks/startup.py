"""Where `llamaterm run`'s time goes from start to exit, on this machine (#23's start-up targets):

    python -m tests.benchmarks.startup --runs 10

Three commands take turns (so a neighbour's load falls on each alike), each timed from start to exit, the median
and spread of --runs, and the CPU time (user + sys) of the command's own process:
  import torch     python -c "import torch": the baseline of the in-process target
  run --local      llamaterm run --local --temperature 0 PROMPT: the model loaded in the command's own process
  run, served      the same without --local, with a `llamaterm serve` of the model up (started here, on a free port)
Then the split: run --local --verbose's start-up parts (medians over the runs) and what the rest of the command
took (Python, the CLI and typer, the reply, the exit); for the served run, where it found the server and what one
run imports (python -X importtime, summed by top-level package).

Python compiles every llamaterm module at each start where it cannot cache bytecode (PYTHONDONTWRITEBYTECODE set, no
__pycache__ in the checkout): the first line says which.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.support.serve_support import LLAMATERM, served

PROMPT = "What is the capital of France?"


def timed(command: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the process, its stderr) of one run; the run must succeed."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    stderr = process.stderr.read() if process.stderr else ""
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    assert status == 0, f"{' '.join(command)} failed: {stderr[-500:]}"
    return wall, usage.ru_utime + usage.ru_stime, stderr


def spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{statistics.median(v):6.3f} s  ({v[0]:.3f}-{v[-1]:.3f})"


def startup_parts(stderr: str) -> dict[str, float]:
    """run --verbose's 'start-up imports 1.02 s, read checkpoint 0.10 s, ... (total 1.80 s)'."""
    found = re.search(r"start-up (.*) \(total", stderr)
    assert found, f"no start-up split in: {stderr[-300:]}"
    return {name: float(s) for name, s in re.findall(r"([a-zA-Z -]+?) ([0-9.]+) s(?:, |$)", found[1])}


def imports_by_package(stderr: str, top: int) -> list[tuple[str, float, int]]:
    """-X importtime's self times summed by top-level package: (package, ms, modules), the largest first."""
    ms: Counter[str] = Counter()
    modules: Counter[str] = Counter()
    for self_us, name in re.findall(r"^import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", stderr, re.M):
        package = name.split(".")[0]
        ms[package] += int(self_us) / 1000
        modules[package] += 1
    return [(p, t, modules[p]) for p, t in ms.most_common(top)]


def bytecode_cached() -> str:
    import llamaterm.app

    cached = (Path(llamaterm.app.__file__).parent / "__pycache__").is_dir()
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not cached:
        return "no (PYTHONDONTWRITEBYTECODE set, no __pycache__): llamaterm's modules compile at each start"
    return "yes" if cached else "written at the first start"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--model", default=None, help="A store name or path (default: the default model).")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--no-server", action="store_true", help="Leave out the run through a server.")
    ap.add_argument("--top", type=int, default=12, help="Packages listed in the served run's imports.")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    run = [LLAMATERM, "run", "--temperature", "0", "--verbose", *model, args.prompt]
    commands = {
        "import torch": [sys.executable, "-c", "import torch"],
        "run --local": [*run[:2], "--local", *run[2:]],
    }
    print(f"bytecode cached: {bytecode_cached()}; load average {os.getloadavg()[0]:.2f} at the start")
    walls: dict[str, list[float]] = {name: [] for name in commands}
    cpus: dict[str, list[float]] = {name: [] for name in commands}
    parts: list[dict[str, float]] = []
    found_s: list[float] = []
    with served(*model) if not args.no_server else contextlib.nullcontext():
        if not args.no_server:
            commands["run, served"] = run
            walls["run, served"], cpus["run, served"] = [], []
        for _ in range(args.runs):
            for name, command in commands.items():
                wall, cpu, stderr = timed(command)
                walls[name].append(wall)
                cpus[name].append(cpu)
                if name == "run --local":
                    parts.append(startup_parts(stderr))
                elif name == "run, served":
                    found = re.search(r"found in ([0-9.]+) s", stderr)
                    assert found, f"the run did not use the server: {stderr[-300:]}"
                    found_s.append(float(found[1]))
        imports = "" if args.no_server else timed(run, os.environ | {"PYTHONPROFILEIMPORTTIME": "1"})[2]

    print(f"\n{'command':14s} {'start to exit: median (min-max)':>32s}   CPU median   over import torch")
    torch_s = statistics.median(walls["import torch"])
    for name in commands:
        over = f"{statistics.median(walls[name]) - torch_s:+.3f} s" if name == "run --local" else ""
        print(f"{name:14s} {spread(walls[name]):>32s}   {statistics.median(cpus[name]):7.3f} s   {over}")

    print("\nrun --local, start-up (medians; --verbose's parts)")
    medians = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    for k, v in medians.items():
        print(f"  {k:24s} {v:6.3f} s")
    rest = statistics.median(walls["run --local"]) - sum(medians.values())
    print(f"  {'the rest':24s} {rest:6.3f} s  (Python, CLI and typer, the reply, the exit)")

    if not args.no_server:
        print(f"\nrun, served: the server found in {statistics.median(found_s):.3f} s (median); one run's imports:")
        packages = imports_by_package(imports, args.top)
        total = sum(t for _, t, _ in imports_by_package(imports, 10_000))
        for package, ms, n in packages:
            print(f"  {package:24s} {ms:6.1f} ms  {n:4d} modules")
        print(f"  {'all':24s} {total:6.1f} ms")


if __name__ == "__main__":
    main()
