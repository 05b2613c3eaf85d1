"""`llamaterm serve` on 127.0.0.1 with the default model on the CPU, driven by the official `openai` client."""

import json
import subprocess
import threading
import time

import httpx2
import openai
import pytest

from llamaterm.engine.checkpoints.sampling_defaults import GGUF_KEYS, from_values
from llamaterm.engine.sampling_params import SamplingParams
from tests.support import DATA
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import LLAMATERM, app_server, llamaterm_serve, metrics

KEY = "test-key"
SERVED = "the served model"  # stands for its name in the parameters below
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with llamaterm_serve("--device", "cpu", "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def test_models_lists_the_served_model(client, model):
    assert "SmolLM2" in model
    assert client.models.list().data[0].model_extra["max_model_len"] == 8192  # the GGUF's context length


def test_chat_streamed_and_whole_agree(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    usage = whole.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert whole.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == whole.choices[0].message.content  # greedy: the same reply either way
    assert len([d for d in deltas if d]) > 1  # it streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_streamed_and_whole_agree(client, model):
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    text = whole.choices[0].text
    assert text.strip() and "".join(c.choices[0].text for c in streamed) == text
    # the tokens' text offsets, where a stop string's start holds text back a while ("Paris" of "Paris!")
    asked = dict(prompt=prompt, max_tokens=8, temperature=0, logprobs=0, stop=["Paris!"])
    logprobs = client.completions.create(model=model, **asked).choices[0].logprobs
    chunks = client.completions.create(model=model, stream=True, **asked)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert " Paris" in logprobs.tokens and offsets == logprobs.text_offset
    # raw text: no chat template, so the prompt is its own tokens and fewer than the chat's
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert 0 < whole.usage.prompt_tokens < chat.usage.prompt_tokens


def test_stop_strings_and_seeds(client, model):
    stopped = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0, stop=["Paris"]
    )
    assert stopped.choices[0].finish_reason == "stop" and "Paris" not in stopped.choices[0].message.content
    sampled = [
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=1.0, seed=seed)
        .choices[0]
        .message.content
        for seed in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1]


def test_eight_concurrent_streams_are_batched(server, client, model):
    replies: list[str] = []
    done = threading.Event()
    seen_batch = []

    def ask(i: int) -> None:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=16,
            stream=True,
        )
        replies.append("".join(c.choices[0].delta.content or "" for c in stream))

    def watch() -> None:
        while not done.is_set():
            seen_batch.append(metrics(server, KEY)["llamaterm_batch_size"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=300)
    done.set()
    watcher.join()
    assert len(replies) == 8 and all(replies)
    assert max(seen_batch) > 1


def test_a_client_that_disconnects_frees_its_blocks(server, client, model):
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=4000, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    busy = metrics(server, KEY)
    assert busy["llamaterm_requests_running"] == 1 and busy["llamaterm_kv_blocks_used"] > 0
    stream.close()
    # 4000 tokens would take minutes on the CPU: only a cancel frees the blocks this soon
    deadline = time.monotonic() + 30
    while (m := metrics(server, KEY))["llamaterm_kv_blocks_used"] or m["llamaterm_requests_running"]:
        assert time.monotonic() < deadline, f"blocks still held: {m}"
        time.sleep(0.1)


def test_a_client_that_leaves_before_a_whole_reply_frees_its_blocks(server, model):
    """A non-streaming request whose client gives up (a timeout) is cancelled while its reply is still coming."""
    impatient = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=4000, extra_body={"ignore_eos": True}
        )
    deadline = time.monotonic() + 30  # 4000 tokens would take minutes on the CPU
    while (m := metrics(server, KEY))["llamaterm_kv_blocks_used"] or m["llamaterm_requests_running"]:
        assert time.monotonic() < deadline, f"blocks still held: {m}"
        time.sleep(0.1)


def test_max_tokens_where_a_request_gives_none_is_openai_s():
    """A chat reply may run to the end of the context, a text completion 16 tokens; a null max_completion_tokens is
    not given (max_tokens then counts)."""
    with FakeEngine(model_name="m", max_context=2048) as engine, app_server(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        client.chat.completions.create(model="m", messages=QUESTION)
        client.completions.create(model="m", prompt="Hi")
        client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=3, extra_body={"max_completion_tokens": None}
        )
        assert [params.max_tokens for _, params in engine.submitted] == [2048, 16, 3]


def test_a_wrong_or_missing_key_gets_401(server, model):
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=server, api_key="wrong-key", max_retries=0).chat.completions.create(
            model=model, messages=QUESTION, max_tokens=1
        )
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert httpx2.get(server + "/models").status_code == 401  # no key at all


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/chat/completions", b"{not json", 400, "parse the JSON"),
        ("/chat/completions", {"model": "no-such-model", "messages": QUESTION}, 404, "does not exist"),
        ("/chat/completions", {"messages": QUESTION}, 400, "model"),
        ("/chat/completions", {"model": SERVED, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ("/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": 42}]}, 400, "content"),
        ("/chat/completions", {"model": SERVED, "messages": "hi"}, 400, "messages"),
        (
            "/chat/completions",
            {"model": SERVED, "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "context",
        ),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "max_tokens": 10**9}, 400, "max_tokens"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "n": 0}, 400, "n must be"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "n": 10_000}, 400, "n must be"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "best_of": 2}, 400, "best_of = 2"),
        (
            "/chat/completions",
            {"model": SERVED, "messages": QUESTION, "logprobs": True, "top_logprobs": 21},
            400,
            "0 to 20",
        ),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "top_logprobs": 2}, 400, "needs logprobs"),
        ("/completions", {"model": SERVED, "prompt": "Hi", "logprobs": 21}, 400, "logprobs must be"),
        (
            "/chat/completions",
            {"model": SERVED, "messages": QUESTION, "logit_bias": {"99999999": 5}},
            400,
            "vocabulary",
        ),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "logit_bias": {"hello": 5}}, 400, "token ids"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "logit_bias": {"\u00b2": 5}}, 400, "token ids"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "logit_bias": {"5": 101}}, 400, "-100 to 100"),
        ("/chat/completions", {"model": SERVED, "messages": QUESTION, "frobnicate": True}, 400, "Unrecognized"),
        (
            "/chat/completions",
            {"model": SERVED, "messages": QUESTION, "chat_template_kwargs": {"x": 1}},
            400,
            "enable_thinking",
        ),
        ("/completions", {"model": SERVED, "prompt": [1, 2, 3]}, 400, "prompt"),
        (
            "/chat/completions",
            {
                "model": SERVED,
                "messages": QUESTION,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": "f"},
            },
            400,
            "tool_choice must be",
        ),
        ("/no/such/endpoint", {}, 404, "no such endpoint"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, model, path, body, status, words):
    if isinstance(body, dict) and body.get("model") == SERVED:
        body = body | {"model": model}
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    reply = httpx2.post(server + path, headers=headers, timeout=60, **sent)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1).choices[0].message.content


def test_numbers_past_the_sampler_s_tables_get_a_400_naming_the_field_and_replies_under_way_go_on(
    server, client, model
):
    """The sampler holds a request's numbers as float32 and int64: one past them failed the step it was written in,
    with every reply in it (top_k 2**63: "Overflow when unpacking long long" for a reply beside it)."""
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=48, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [next(stream)]  # the reply is under way
    for field, value in (
        ("top_k", 2**63),
        ("temperature", 10**400),
        ("repetition_penalty", 1e-300),
        ("max_completion_tokens", 0),
    ):
        body = {"model": model, "messages": QUESTION, field: value}
        reply = httpx2.post(server + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_text_that_is_not_unicode_is_refused_and_the_server_keeps_serving(server, client, model):
    """One message holding a lone surrogate (valid JSON, not Unicode text) ended the engine process: every later
    request got 503 "the engine process has exited"."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "\ud800 hi"}]}).encode()
    reply = httpx2.post(
        server + "/chat/completions",
        content=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert reply.status_code == 400 and "not valid Unicode" in reply.json()["error"]["message"]
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1).choices[0].message.content


class FailingEngine(FakeEngine):
    """A fake engine whose submit fails with an exception no engine should raise, for the prompt "fail"."""

    def submit(self, prompt, params=None, **options):
        if prompt == "fail":
            raise RuntimeError("a bug")
        return super().submit(prompt, params, **options)


def test_an_unforeseen_failure_is_an_openai_error_and_the_server_keeps_serving():
    with FailingEngine(model_name="m") as engine, app_server(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="m", prompt="fail", max_tokens=1)
        assert err.value.body["type"] == "server_error" and "RuntimeError: a bug" in err.value.body["message"]
        assert client.completions.create(model="m", prompt="hello", max_tokens=1).choices[0].text


def llamaterm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LLAMATERM, *args], capture_output=True, text=True, timeout=300)


def test_run_on_the_server_answers_as_the_local_engine(server):
    args = ["run", "--json", "--temperature", "0", "--max-tokens", "8", "What is the capital of France?"]
    remote = llamaterm(*args, "--server", server, "--api-key", KEY)
    local = llamaterm(*args, "--device", "cpu", "--local")  # not the server below, which is announced
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
    remote_reply, local_reply = json.loads(remote.stdout), json.loads(local.stdout)
    assert remote_reply["text"] == local_reply["text"] and "Paris" in remote_reply["text"]
    for key in ("model", "finish_reason", "prompt_tokens", "generated_tokens"):
        assert remote_reply[key] == local_reply[key], key
    assert remote_reply["ttft_s"] > 0


@pytest.mark.parametrize(
    "url, key, args, words",
    [
        ("http://127.0.0.1:9/v1", KEY, [], "cannot reach"),  # the discard port: nothing listens
        ("SERVER/no/such/api", KEY, [], "not an OpenAI-compatible server"),
        ("SERVER", "wrong-key", [], "refused the API key"),
        ("SERVER", KEY, ["--model", "no-such-model"], "has no model 'no-such-model'"),
        ("SERVER", KEY, ["--max-tokens", "100000"], "refused the request (400)"),
    ],
)
def test_run_on_a_bad_server_fails_in_one_line(server, url, key, args, words):
    out = llamaterm(
        "run", "--server", url.replace("SERVER", server.removesuffix("/v1")), "--api-key", key, *args, "hello"
    )
    assert out.returncode == 1 and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("llamaterm: ")


def test_a_port_in_use_fails_before_the_model_loads(server):
    port = server.split(":")[2].split("/")[0]
    out = llamaterm("serve", "--port", port)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_completions_read_special_token_text_as_those_tokens(client, model):
    """As vLLM and llama.cpp's server read a prompt; parse_special: false keeps it text. The oracle: llama.cpp's ids
    for the default model (tests/data/smollm2_tokenizer.json)."""
    case = next(c for c in json.loads((DATA / "smollm2_tokenizer.json").read_text())["cases"] if "<|im_" in c["text"])
    parsed = client.completions.create(model=model, prompt=case["text"], max_tokens=1)
    literal = client.completions.create(
        model=model, prompt=case["text"], max_tokens=1, extra_body={"parse_special": False}
    )
    assert (parsed.usage.prompt_tokens, literal.usage.prompt_tokens) == (
        len(case["ids_parse_special"]),
        len(case["ids"]),
    )
    with pytest.raises(openai.BadRequestError) as err:  # a chat message's content is always text
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, extra_body={"parse_special": True})
    assert err.value.body["param"] == "parse_special"


def test_absent_sampling_fields_take_the_model_defaults():
    """As vLLM fills them from generation_config.json: here a model whose defaults a GGUF gave."""
    defaults = from_values({"temperature": 0.6, "top_k": 20}, "gguf", "m.gguf", GGUF_KEYS)
    with FakeEngine(model_name="m", sampling_defaults=defaults) as engine, app_server(engine) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=1)
        client.completions.create(model="m", prompt="hi", max_tokens=1, temperature=0, extra_body={"min_p": 0.2})
        (_, model_own), (_, told) = engine.submitted
    assert model_own == SamplingParams(max_tokens=1, temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)
    assert told == SamplingParams(max_tokens=1, temperature=0, top_k=20, top_p=0.95, min_p=0.2)
