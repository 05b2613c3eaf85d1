"""`llamaterm run` and `chat --plain` through a `llamaterm serve` of the default model on the CPU, against the same
commands with --local (the model loaded in the command's own process) as the oracle: the same reply and the same
--json, whichever way it was made."""

import json
import re

import pytest

from tests.support.cli import llamaterm
from tests.support.serve_support import served

pytestmark = pytest.mark.slow  # the default model, loaded by a server and by each --local run

QUESTION = "What is the capital of France?"
MEASURED = {"ttft_s", "tokens_per_s"}  # times, measured where the tokens arrive
# cached_tokens: the server's prefix cache holds the blocks of its earlier requests, which a fresh --local run lacks


@pytest.fixture(scope="module")
def server():
    with served("--device", "cpu") as s:
        yield s


@pytest.fixture(scope="module")
def schema(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("schema") / "city.json"
    path.write_text(json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
    return str(path)


@pytest.mark.parametrize(
    "flags",
    [
        ["--temperature", "0"],
        ["--temperature", "0.8", "--seed", "7", "--top-k", "20", "--repetition-penalty", "1.1", "--stop", " Paris"]
        + ["--system", "Answer in one sentence."],
        ["--temperature", "0", "--logprobs", "2", "--max-tokens", "6"],
        ["--temperature", "0", "--json-schema", "SCHEMA"],
    ],
    ids=["greedy", "seeded", "logprobs", "schema"],
)
def test_run_json_is_the_same_through_the_server_and_local(server, schema, flags):
    flags = [schema if f == "SCHEMA" else f for f in flags]
    remote = llamaterm("run", "--json", "--verbose", *flags, QUESTION)
    local = llamaterm("run", "--json", "--local", "--verbose", *flags, QUESTION)
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
    assert "on the server at " + server.url in remote.stderr
    assert {"imports", "read checkpoint", "weights to device", "KV cache", "warm-up"} <= set(startup(local.stderr))
    shown, oracle = json.loads(remote.stdout), json.loads(local.stdout)
    assert shown["token_ids"]  # the server sent its tokens' ids
    assert same(shown, oracle)


def same(shown: dict, oracle: dict) -> bool:
    """The same --json object, less the times and the cache's hits; the logprobs the same up to the rounding of a
    prompt's prefill split otherwise (the server's prefix cache held its start)."""
    drop = MEASURED | {"cached_tokens"}
    shown, oracle = ({k: v for k, v in d.items() if k not in drop} for d in (shown, oracle))
    assert numbers(shown) == pytest.approx(numbers(oracle), abs=1e-4)
    return without_numbers(shown) == without_numbers(oracle)


def numbers(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [x for item in items for x in numbers(item)]


def without_numbers(value):
    if isinstance(value, float):
        return None
    if isinstance(value, dict):
        return {k: without_numbers(v) for k, v in value.items()}
    return [without_numbers(v) for v in value] if isinstance(value, list) else value


def test_run_raw_and_each_line_are_the_same_through_the_server_and_local(server):
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    for args, stdin in (
        (["--raw", "--temperature", "0", "-"], prompt),
        (["--each-line", "--json", "--temperature", "0", "--max-tokens", "8"], "Name a fruit.\nName a city.\n"),
    ):
        remote, local = llamaterm("run", *args, stdin=stdin), llamaterm("run", "--local", *args, stdin=stdin)
        assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
        if "--json" in args:
            lines = [[json.loads(line) for line in r.stdout.splitlines()] for r in (remote, local)]
            assert len(lines[0]) == len(lines[1]) == 2 and all(map(same, *lines))
        else:
            assert remote.stdout == local.stdout and remote.stdout.strip()


def test_chat_plain_is_the_same_through_the_server_and_local(server):
    turns = f"{QUESTION}\nAnd of Italy?\n"
    remote = llamaterm("chat", "--plain", "--temperature", "0", "--max-tokens", "16", stdin=turns)
    local = llamaterm("chat", "--plain", "--local", "--temperature", "0", "--max-tokens", "16", stdin=turns)
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
    assert remote.stdout == local.stdout and "Paris" in remote.stdout
    assert server.url.removesuffix("/v1").removeprefix("http://") in remote.stderr  # where it chatted: the server


def startup(stderr: str) -> dict[str, float]:
    """Where --verbose says a local start-up's time went: {part: seconds}."""
    (line,) = [line for line in stderr.splitlines() if ": start-up " in line]
    split = line.split(": start-up ", 1)[1].split(" (total")[0]
    return {name: float(s) for name, s in re.findall(r"([^,]+?) (\d+\.\d+) s(?:, |$)", split)}


def test_the_plain_chat_goes_on_after_the_server_refuses_a_prompt(server):
    """A server refuses a prompt over the context in the reply's events: the chat said so and exited, where the
    engine in this process refuses it at submit and the chat goes on."""
    out = llamaterm("chat", "--plain", "--max-tokens", "4", stdin="word " * 9000 + "\nWhat is 2+2?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "context" in out.stderr and out.stderr.count("tok/s") == 1  # the second question answered
