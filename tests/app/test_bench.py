"""`llamaterm bench` end to end on the CPU, on random weights in a tiny model's shapes."""

import json
import re
from pathlib import Path

import pytest

from tests.support.cli import llamaterm

pytestmark = pytest.mark.slow  # `llamaterm bench` in subprocesses


def bench_json(*args: str) -> dict:
    out = llamaterm("bench", "--model", "synthetic:tiny", "--device", "cpu", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_bench_token_ids_in_process_json_on_cpu():
    # 32 tokens: enough that the 2 ms poll sees the static window's span on a fast machine
    r = bench_json(
        "--workload",
        "ids",
        "--sessions",
        "1,2",
        "--window",
        "0.3",
        "--warmup",
        "0.1",
        "--tokens",
        "32",
        "--prompt",
        "16",
    )
    assert r["model"].startswith("tiny test shapes") and r["device"] == "cpu"
    assert r["workload"]["engine"] == "inline" and not r["workload"]["chat"]
    assert r["workload"]["sampling"] == {"temperature": 0.0}
    # the tiny shapes (engine/bench.py): hidden 256, 8 heads of 32 (2 for K/V), ffn 512, vocab 512, 2 layers,
    # 4-bit group 32 with fp16 scales, read packed on the CPU too (9/16 of a byte per weight); fp32 norms; the
    # lm_head, not the embedding
    per_layer = (256 + 64 + 64) * 256 + 256 * 256 + 2 * 512 * 256 + 256 * 512
    norms = 2 * 2 * 256 + 256
    assert r["limit"]["weight_bytes_per_step"] == (2 * per_layer + 512 * 256) * 9 // 16 + 4 * norms
    assert {"imports", "make random weights", "KV cache", "warm-up", "first request"} <= set(r["startup_s"])
    assert r["ttft"]["prompt_tokens"] == 512 and r["ttft"]["ms"] > 0
    assert r["launches"] == {"decode": None, "16-token prefill": None}  # counted on CUDA only
    assert [row["sessions"] for row in r["decode"]] == [1, 2]
    assert r["decode"][0]["vs_one_session"] == 1.0
    for row in r["decode"]:
        assert row["static_tok_s"] > 0 and row["dynamic_tok_s"] > 0 and row["max_step_ms"] > 0
        assert 0 < row["gap_ms"]["p50"] <= row["gap_ms"]["p99"] <= row["gap_ms"]["max"]


def test_bench_chat_through_the_engine_process_json_on_cpu():
    """The default workload: chat messages, every filter on, the engine process; the chat prompt mix."""
    r = bench_json("--sessions", "2", "--window", "0.5", "--warmup", "0.1", "--tokens", "16", "--prompt-mix", "chat")
    w = r["workload"]
    assert w["engine"] == "process" and w["chat"] and w["sampling"]["top_k"] == 40
    assert w["prompt_mix"]["prompts"] == [[0.7, 16, 255], [0.25, 256, 1023], [0.05, 1024, 2000]]
    assert "launches" not in r  # counted in this process only
    row = r["decode"][0]
    assert row["static_tok_s"] > 0 and row["dynamic_tok_s"] > 0 and row["max_step_ms"] is None
    assert row["steps_per_s"] > 0 and row["host_ms_per_step"] > 0  # the child's own figures


def test_bench_table_and_bad_input():
    out = llamaterm(
        "bench",
        "--model",
        "synthetic:tiny",
        "--device",
        "cpu",
        "--sessions",
        "1",
        "--tokens",
        "32",
        "--prompt",
        "8",
        "--window",
        "0.5",
        "--warmup",
        "0.1",
    )  # enough tokens that the 2 ms poll sees the decode span
    assert out.returncode == 0, out.stderr
    assert "static tok/s" in out.stdout and "TTFT, 512-token prompt" in out.stdout and "gap p50 ms" in out.stdout
    assert "workload: chat messages, temperature 0.8" in out.stdout
    # off a terminal, each part's start is a line on stderr, so a run cut off still shows where it stopped
    parts = [line.split("] ", 1)[1] for line in out.stderr.splitlines() if line.startswith("[")]
    assert parts[0].endswith("loading the model") and parts[-1].endswith("closed loop, 1 sessions (1 s)")
    bad = llamaterm("bench", "--model", "synthetic:nope", "--device", "cpu")
    assert bad.returncode == 1 and bad.stderr.splitlines()[-1].startswith("llamaterm: unknown model 'synthetic:nope'")
    bad = llamaterm("bench", "--sessions", "one")
    assert bad.returncode == 2 and "--sessions takes counts" in bad.stderr
    bad = llamaterm("bench", "--workload", "poems")
    assert bad.returncode == 2 and "unknown workload 'poems'" in bad.stderr
    bad = llamaterm("bench", "--peer", "hf", "--engine", "process")  # the peer runs beside the engine in this process
    assert bad.returncode == 2 and "leave out --engine process" in bad.stderr


def test_bench_under_a_json_schema_says_where_masked_steps_wait():
    """The default model's replies under a schema, through the engine process, each run just after its free twin
    on the same engine: each session count's masks' fill time, the engine's waits and the share of tokens the
    grammar forced, from the child's own counts, and the pair's ratio. The closed loop's two prompts take 0.5-1 s
    to prefill on two cores: its window opens after them, on decode steps."""
    schema = Path(__file__).parents[1] / "benchmarks" / "people.schema.json"
    out = llamaterm(
        "bench", "--device", "cpu", "--json-schema", str(schema), "--sessions", "2", "--tokens", "16",
        "--window", "1", "--warmup", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "through the engine process, replies under a JSON schema" in out.stdout
    masks = re.search(
        r"\n +2 sessions, a step's grammar masks: ready in ([\d.]+) ms on their thread; the engine waited ([\d.]+) "
        r"ms for the tokens they start from and ([\d.]+) ms for them; (\d+)% of the tokens forced by the grammar, "
        r"computed unsampled\n",
        out.stdout,
    )
    assert masks is not None, out.stdout
    fill, tokens, wait, forced = map(float, masks.groups())
    assert fill > 0 and tokens >= 0 and wait >= 0 and forced > 0  # the schema's keys and punctuation
    assert re.search(r"\n +2 free +[\d,.]+ .*\n +2 schema +[\d,.]+ ", out.stdout), out.stdout
    assert re.search(r"under the schema, pair by pair, % of free: static \d+%; closed loop \d+%\n", out.stdout)


def test_bench_beside_transformers_on_cpu():
    """make bench-cpu's table: three runs of each engine on the same prompts, medians, TTFT and load time."""
    out = llamaterm(
        "bench",
        "--model",
        "synthetic:tiny",
        "--device",
        "cpu",
        "--sessions",
        "1",
        "--tokens",
        "8",
        "--prompt",
        "8",
        "--peer",
        "hf",
        "--workload",
        "ids",
        "--window",
        "0.3",
        "--warmup",
        "0.1",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    at = lines.index("one session, 8-token prompts, 8 new tokens, medians of 3 runs:")
    assert lines[at + 1].split() == ["tok/s", "TTFT", "ms", "load", "s", "runs", "(tok/s)"]
    for line, name in zip(lines[at + 2 : at + 4], ("llamaterm", "Hugging Face transformers"), strict=True):
        assert line.startswith(name)
        figures = line[len(name) :].split()
        assert len(figures) == 6 and float(figures[0].replace(",", "")) > 0  # median, TTFT, load, three runs
        assert sorted(map(float, figures[3:]))[1] == float(figures[0].replace(",", ""))
    assert lines[at + 4].startswith("speed-up ")  # random weights on each side: no token comparison


def test_bench_help_names_every_synthetic_model():
    """The CLI cannot import the engine's list (torch) at start-up, so its help names the shapes itself."""
    from llamaterm.engine.serving.synthetic_model import SYNTHETIC

    help_text = " ".join(llamaterm("bench", "--help").stdout.split())
    assert all(name in help_text for name in SYNTHETIC), help_text


def test_bench_speculation_with_and_without_on_cpu():
    """--speculate: editing requests and open chat, greedy and sampled, with and without drafts: the same tokens."""
    r = bench_json("--speculate", "ngram", "--sessions", "1,2", "--tokens", "16")
    assert r["speculate"] == "ngram" and r["edit_texts"] == ["inventory.txt", "matrix.txt", "tokenizer.txt"]
    kinds = [(row["workload"], row["sampling"], row["sessions"]) for row in r["rows"]]
    assert kinds == [(w, s, n) for w in ("editing", "open chat") for s in ("greedy", "sampled") for n in (1, 2)]
    for row in r["rows"]:
        assert row["same_tokens"] and row["off_tok_s"] > 0 and row["on_tok_s"] > 0
        n, prompts = row["sessions"], 3 if row["workload"] == "editing" else 4
        assert row["tokens"] == -(-max(n, prompts) // n) * n * 16  # every prompt, in waves of n sessions
        # on the CPU no step overlaps the next, so none gave its overlap up for drafts
        assert row["draft_steps"] <= row["steps"][1] and row["serial_steps"] == 0
    assert any(row["acceptance"] for row in r["rows"])  # random weights repeat themselves: some drafts are kept
    out = llamaterm("bench", "--speculate", "draft", "--device", "cpu")
    assert out.returncode == 2 and "--speculate takes ngram, or draft with --draft MODEL" in out.stderr
