"""Tool calls through `llamaterm serve`, driven by the official `openai` client: the prompt the engine gets is the
model's template rendered by transformers with the tools; a reply in the family's syntax comes back as
message.tool_calls (whole) and delta.tool_calls (streamed) with finish_reason "tool_calls"; the call's result goes
back in the next request; bad tools and tool messages get a 400 naming the field, and the server keeps serving.

The fast tests run on a fake engine holding Qwen3's real tokenizer and template that replies with a call written
here; the round trips on a tiny random model and on the default model need the grammar enforced by the engine."""

import json
from collections.abc import Callable

import httpx2
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.serving.engine import Engine
from tests.support import DATA
from tests.support.fake_engine import FakeEngine
from tests.support.family_oracle import save_tiny_qwen3
from tests.support.serve_support import app_server, llamaterm_serve
from tests.support.tokenizer_files import QWEN3_FILES, harmony_files

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
QWEN3_TEMPLATE = (DATA / "qwen3-0.6b.jinja").read_text(encoding="utf-8")


def qwen3_reply(prompt: str) -> str:
    return ANSWER if "<tool_response>" in prompt else CALL  # a prompt holding a tool's reply gets words


class ToolFakeEngine(FakeEngine):
    """The fake engine with a model's tokenizer (its template too: Qwen3's by default), which the server renders
    prompts with; it answers the prompt's text as `reply` says, and keeps what it was sent."""

    def __init__(self, tokenizer: Tokenizer | None = None, reply: Callable[[str], str] = qwen3_reply):
        super().__init__(lambda messages: reply(messages[-1]["content"]))
        self.tokenizer = tokenizer or Tokenizer.from_hf_dir(QWEN3_FILES)
        self.prompts: list[str] = []

    def submit(self, prompt, params=None, **options):
        if isinstance(prompt, list):  # rendered as the engine renders it, tools and all
            thinking, tools = options.get("enable_thinking"), options.get("tools")
            ids = self.tokenizer.encode_chat(prompt, enable_thinking=thinking, tools=tools)
            prompt = self.tokenizer.decode(ids)  # (the fake reads a string as a user message's text)
            self.prompts.append(prompt)
        return super().submit(prompt, params, **options)


@pytest.fixture(scope="module")
def fake():
    with ToolFakeEngine() as engine:
        yield engine


@pytest.fixture(scope="module")
def fake_url(fake):
    with app_server(fake) as url:
        yield url


@pytest.fixture(scope="module")
def client(fake_url):
    return openai.OpenAI(base_url=fake_url, api_key="unused", max_retries=0)


def qwen3_prompt(messages: list[dict], tools: list[dict]) -> str:
    """The oracle: transformers renders Qwen3's template, the calls' arguments as objects (as its docs ask)."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    want, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=QWEN3_TEMPLATE, add_generation_prompt=True
    )
    return want[0]


def test_a_call_comes_back_whole_and_its_result_goes_back(fake, client):
    reply = client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert fake.prompts[-1] == qwen3_prompt(QUESTION, TOOLS)
    assert fake.submitted[-1][1].grammar is None  # "auto": decoding stays free

    turn = [*QUESTION, choice.message.model_dump(exclude_none=True)]
    turn.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    answer = client.chat.completions.create(model="fake-llama", messages=turn, tools=TOOLS)
    assert answer.choices[0].message.content == ANSWER and answer.choices[0].finish_reason == "stop"
    assert not answer.choices[0].message.tool_calls
    sent = json.loads(json.dumps(turn))
    sent[1]["content"] = ""  # a call's message without text: "" to the template (as vLLM gives it; Qwen3's needs one)
    assert fake.prompts[-1] == qwen3_prompt(sent, TOOLS)


def test_a_call_streams_as_deltas(client):
    chunks = list(client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert len([c for c in chunks if c.choices[0].delta.tool_calls]) > 1  # the arguments came in pieces
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    (call,) = calls.values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["id"].startswith("call_") and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "choice, names, parallel",
    [
        ("required", ["get_weather", "add"], True),
        ({"type": "function", "function": {"name": "add"}}, ["add"], False),  # one call, even where parallel
    ],
)
def test_required_and_named_choices_ask_the_engine_for_a_grammar(fake, client, choice, names, parallel):
    client.chat.completions.create(
        model="fake-llama", messages=QUESTION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=True
    )
    grammar = fake.submitted[-1][1].grammar
    assert grammar.kind == "lark"
    assert [n for n in ("get_weather", "add") if f'"const": "{n}"' in grammar.text] == names
    assert (")*" in grammar.text.splitlines()[0]) == parallel
    client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS, tool_choice=choice)
    assert ")*" not in fake.submitted[-1][1].grammar.text.splitlines()[0]  # one call unless asked for more


@pytest.mark.parametrize("name", ["auto", "none", "required"])
def test_a_tool_named_like_a_mode_is_chosen_by_its_name(fake, client, name):
    """A named tool_choice is the function, never the mode its name spells (a tool named "auto" was not forced,
    one named "none" kept the reply from being read for calls)."""
    tool = {"type": "function", "function": {**ADD["function"], "name": name}}
    choice = {"type": "function", "function": {"name": name}}
    client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=[WEATHER, tool], tool_choice=choice)
    grammar = fake.submitted[-1][1].grammar
    assert grammar is not None and f'"const": "{name}"' in grammar.text and '"const": "get_weather"' not in grammar.text


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_the_reply_as_text(fake, client):
    """As vLLM does by default: the model knows the tools; its reply is not read for calls."""
    reply = client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop" and fake.prompts[-1] == qwen3_prompt(QUESTION, TOOLS)


TOOL_REPLY = {"role": "tool", "tool_call_id": "call_1", "content": "21"}
ASKED = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add"}}]}
SET_TOOL = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
    },
}
DEEP_SCHEMA: dict = {"type": "string"}
for _ in range(200):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
DEEP_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": DEEP_SCHEMA}}},
}
DEEP_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "f", "arguments": '{"a": ' + "[" * 900 + "]" * 900 + "}"},
}


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": [WEATHER, WEATHER]}, "tools[1]", "name of another tool"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strung"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
            "JSON schema",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "required"),
        ({"tools": [SET_TOOL], "tool_choice": "required"}, "tools[0].function.parameters", "uniqueItems"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"messages": [*QUESTION, {"role": "tool", "content": "21"}]}, "messages[1].tool_call_id", "tool_call_id"),
        ({"messages": [*QUESTION, ASKED, TOOL_REPLY]}, "messages[1].tool_calls[0]", "arguments"),
        ({"messages": [*QUESTION, ASKED | {"tool_calls": "add"}]}, "messages[1].tool_calls", "array"),
        ({"tools": [DEEP_TOOL]}, "tools[0].function.parameters", "nests deeper"),
        (
            {"messages": [*QUESTION, {"role": "assistant", "tool_calls": [DEEP_CALL]}]},
            "messages[1].tool_calls[0]",
            "nested",
        ),
    ],
)
def test_bad_tools_and_tool_messages_get_a_400_naming_the_field(fake_url, client, fields, param, words):
    body = {"model": "fake-llama", "messages": QUESTION} | fields
    reply = httpx2.post(fake_url + "/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="fake-llama", messages=QUESTION, max_tokens=2).choices[0].message


def test_a_tool_whose_schema_is_not_enforced_is_taken_where_the_reply_is_free(fake, client):
    """A tool with a keyword llguidance does not implement (a Pydantic set's uniqueItems) goes to the template
    under "auto"; forced ("required"), it is refused (above)."""
    reply = client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=[SET_TOOL, *TOOLS])
    assert reply.choices[0].finish_reason == "tool_calls" and fake.prompts[-1] == qwen3_prompt(
        QUESTION, [SET_TOOL, *TOOLS]
    )


def test_tools_on_text_completions_are_refused(fake_url):
    reply = httpx2.post(fake_url + "/completions", json={"model": "fake-llama", "prompt": "hi", "tools": TOOLS})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"


# ---- gpt-oss: harmony's channels and calls ----

GPT_OSS_TEMPLATE = (DATA / "gpt-oss.jinja").read_text(encoding="utf-8")
THOUGHT = "Need the weather tool."
HARMONY_CALL = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
HARMONY_ANSWER = (
    f"<|channel|>analysis<|message|>It is clear.<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
)
THINK_ANSWER = f"<think>It is clear.</think>{ANSWER}"  # the form serve gives every model's thinking in


def gpt_oss_reply(prompt: str) -> str:
    """A call where the prompt offers tools and holds no tool's reply yet, else the answer."""
    return HARMONY_CALL if "namespace functions" in prompt and "<|start|>functions." not in prompt else HARMONY_ANSWER


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    tokenizer = Tokenizer.from_hf_dir(harmony_files(tmp_path_factory.mktemp("gpt-oss")))
    with ToolFakeEngine(tokenizer, gpt_oss_reply) as engine, app_server(engine) as url:
        yield engine, openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def streamed(client: openai.OpenAI, **request) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed reply as the client gathers it: (content, [(name, arguments)], finish_reason)."""
    chunks = list(client.chat.completions.create(model="fake-llama", stream=True, **request))
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return content, [(name, arguments) for name, arguments in calls.values()], chunks[-1].choices[0].finish_reason


def test_gpt_oss_thinks_and_answers_as_other_thinking_models_do(gpt_oss):
    """Without tools, a harmony reply comes back with its analysis in a <think> block before its final answer."""
    _, client = gpt_oss
    reply = client.chat.completions.create(model="fake-llama", messages=QUESTION)
    assert reply.choices[0].message.content == THINK_ANSWER and reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls
    assert streamed(client, messages=QUESTION) == (THINK_ANSWER, [], "stop")


def test_a_gpt_oss_call_comes_back_whole_and_streamed_and_its_result_goes_back(gpt_oss):
    engine, client = gpt_oss
    choice = client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == f"<think>{THOUGHT}</think>"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    arguments = [("get_weather", '{"city": "Paris"}')]
    assert streamed(client, messages=QUESTION, tools=TOOLS) == (f"<think>{THOUGHT}</think>", arguments, "tool_calls")

    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    turn = [*QUESTION, choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(model="fake-llama", messages=turn, tools=TOOLS).choices[0]
    assert answer.message.content == THINK_ANSWER and answer.finish_reason == "stop"
    # the oracle: transformers renders gpt-oss's template with the call's thinking in its field (the template keeps
    # it: the answer is not given yet) and its arguments as an object
    asked = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    sent = [*QUESTION, {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [asked]}, result]
    want, _ = render_jinja_template(
        conversations=[sent], tools=TOOLS, chat_template=GPT_OSS_TEMPLATE, add_generation_prompt=True
    )
    assert engine.prompts[-1] == want[0] and f"<|message|>{THOUGHT}<|end|>" in want[0]


def test_gpt_oss_forced_calls_use_harmonys_syntax_and_none_reads_no_calls(gpt_oss):
    engine, client = gpt_oss
    client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS, tool_choice="required")
    assert '"commentary to=functions.get_weather "' in engine.submitted[-1][1].grammar.text
    reply = client.chat.completions.create(model="fake-llama", messages=QUESTION, tools=TOOLS, tool_choice="none")
    choice = reply.choices[0]
    assert choice.message.content == f"<think>{THOUGHT}</think>" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


# ---- round trips through the engine: the grammar makes even a random model call a tool ----


def round_trip(client: openai.OpenAI, model: str) -> None:
    """tool_choice "required" gives a valid call (the tool's only argument is one of two cities, so even a random
    model's forced call ends); its result sent back gives a reply."""
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=64
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    turn = [*QUESTION, choice.message.model_dump(exclude_none=True)]
    turn.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    answer = client.chat.completions.create(model=model, messages=turn, tools=[WEATHER], max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3 with <tool_call> and </tool_call> as tokens and Qwen3's real template."""
    folder = tmp_path_factory.mktemp("qwen3-tools") / "tiny-qwen3"
    return save_tiny_qwen3(
        folder, ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_start|>", "<|im_end|>"], 2048
    )


@pytest.mark.slow
def test_a_round_trip_on_a_tiny_random_model(tiny_qwen3):
    with Engine.from_model(EngineConfig(model=str(tiny_qwen3), device="cpu", kv_tokens=2048)) as engine:
        with app_server(engine) as url:
            round_trip(openai.OpenAI(base_url=url, api_key="unused", max_retries=0), engine.model_name)


@pytest.mark.slow
def test_a_round_trip_on_the_default_model():
    with llamaterm_serve("--device", "cpu") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        round_trip(client, client.models.list().data[0].id)
