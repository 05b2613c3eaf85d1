"""Structured output through `llamaterm serve`: OpenAI's response_format and vLLM's and SGLang's grammar fields,
driven by the official `openai` client. On a fake engine: what reaches the engine (the schema as the client
sends it, by the client's own to_strict_json_schema) and the 400s that name the field; on real models: replies
constrained to a pydantic model, parsed by the client."""

import json
from typing import Literal

import httpx2
import openai
import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from llamaterm.engine.sampling_params import Grammar
from llamaterm.engine.serving.grammar import GrammarError
from tests.support.cli import llamaterm
from tests.support.fake_engine import FakeEngine
from tests.support.serve_support import app_server, llamaterm_serve
from tests.support.tiny_models import write_tiny_llama

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Capital(BaseModel):
    capital: str


class City(BaseModel):
    name: str
    population: int


class Verdict(BaseModel):  # every value from a short list: a random model's constrained reply ends
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def fake():
    with FakeEngine(reply='{"name": "Paris", "population": 2102650}', model_name="m") as engine:
        yield engine


@pytest.fixture(scope="module")
def client(fake):
    with app_server(fake) as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_model_sends_its_schema_to_the_engine(fake, client):
    reply = client.chat.completions.parse(model="m", messages=QUESTION, response_format=City)
    assert reply.choices[0].message.parsed == City(name="Paris", population=2102650)
    assert fake.submitted[-1][1].grammar == Grammar("json_schema", json.dumps(to_strict_json_schema(City)))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields, grammar",
    [
        ({"response_format": {"type": "json_object"}}, Grammar("json")),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            Grammar("json_schema", json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, Grammar("json")),
        ({"guided_json": SCHEMA}, Grammar("json_schema", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, Grammar("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]{3}"}, Grammar("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", 'no "way"']}, Grammar("lark", 'start: "yes" | "no \\"way\\""')),
        ({"guided_grammar": 'start: "a"+'}, Grammar("lark", 'start: "a"+')),
        ({"structured_outputs": {"json": SCHEMA}}, Grammar("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "a|b"}}, Grammar("regex", "a|b")),
        ({"structured_outputs": {"choice": ["x"]}}, Grammar("lark", 'start: "x"')),
        ({"structured_outputs": {"json_object": True}}, Grammar("json")),
        ({"regex": "a|b"}, Grammar("regex", "a|b")),  # SGLang's
        ({"ebnf": 'root ::= "a" | "b"'}, Grammar("lark", gbnf_to_lark('root ::= "a" | "b"'))),  # GBNF, to Lark
    ],
)
def test_each_field_reaches_the_engine_as_a_grammar(fake, client, fields, grammar):
    client.chat.completions.create(model="m", messages=QUESTION, max_tokens=2, extra_body=fields)
    assert fake.submitted[-1][1].grammar == grammar
    client.completions.create(model="m", prompt="The capital of France is", max_tokens=2, extra_body=fields)
    assert fake.submitted[-1][1].grammar == grammar


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"uniqueItems": True}}}},
            "response_format",
            "uniqueItems",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"format": "zip"}}}},
            "response_format",
            "Unknown format: zip",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/$defs/x"}}}},
            "response_format",
            "/$defs/x",
        ),
        ({"response_format": {"type": "json"}}, "response_format", '{"type": "json_object"}'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "a name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}},
            "response_format",
            "schema must be a JSON Schema object",
        ),
        ({"guided_json": '{"type": "object"'}, "guided_json", "not valid JSON"),
        ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "at least one string"),
        ({"guided_choice": "yes"}, "guided_choice", "an array of strings"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "neither Lark nor GBNF"),
        ({"ebnf": "start: nothing"}, "ebnf", 'unknown name: "nothing"'),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "one of json, regex"),
        ({"structured_outputs": {"schema": {}}}, "structured_outputs", "one of json, regex"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "json_object must be true"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs", "regex must be a regular expression"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "give one of them"),
    ],
)
def test_a_refused_grammar_is_a_400_naming_its_field_and_the_server_keeps_serving(client, fields, param, words):
    for create in (
        lambda: client.chat.completions.create(model="m", messages=QUESTION, extra_body=fields),
        lambda: client.completions.create(model="m", prompt="hi", extra_body=fields),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.body["param"] == param and words in err.value.body["message"], err.value.body
        assert err.value.body["message"].startswith(param + ": ")
    assert client.chat.completions.create(model="m", messages=QUESTION, max_tokens=1).choices[0].message.content


class VocabularyRefuses(FakeEngine):
    """An engine whose model's vocabulary cannot begin any grammar: it refuses each at submit."""

    def submit(self, prompt, params=None, **options):
        if params is not None and params.grammar is not None:
            raise GrammarError("the regular expression cannot be matched: no token of the model's vocabulary begins it")
        return super().submit(prompt, params, **options)


def test_a_grammar_the_engine_refuses_at_submit_is_a_400_naming_its_field():
    with VocabularyRefuses(model_name="m") as engine, app_server(engine) as url:
        reply = httpx2.post(
            url + "/chat/completions",
            json={"model": "m", "messages": QUESTION, "structured_outputs": {"regex": "[0-9]+"}},
            timeout=30,
        )
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "structured_outputs"
        assert "no token of the model's vocabulary begins it" in error["message"]


# ---- constrained replies from real models (the engine enforces the grammar) ----


@pytest.mark.slow
def test_parse_returns_an_object_from_a_tiny_random_model(tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", context_length=512)
    with llamaterm_serve("--device", "cpu", "--model", str(tiny)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for seed in range(3):
            reply = client.chat.completions.parse(
                model=model, messages=QUESTION, response_format=Verdict, max_tokens=64, temperature=1, seed=seed
            )
            assert isinstance(reply.choices[0].message.parsed, Verdict)
            assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_parse_returns_an_object_from_the_default_model():
    with llamaterm_serve("--device", "cpu") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.parse(model=model, messages=QUESTION, response_format=Capital, max_tokens=64)
        answer = reply.choices[0].message.parsed
        assert isinstance(answer, Capital) and answer.capital == "Paris"
        stream = client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=64,
            stream=True,
            response_format={"type": "json_object"},
        )
        assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), dict)


# ---- llamaterm run --json-schema / --regex / --grammar ----


CITY = Capital.model_json_schema()


@pytest.fixture
def files(tmp_path):
    texts = {
        "city.json": json.dumps(CITY),
        "broken.json": '{"type": "object",',
        "unique.json": '{"type": "array", "uniqueItems": true}',
        "yes_no.gbnf": 'root ::= "yes" | "no"',
        "broken.lark": "start: (",
    }
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, words",
    [
        (["--json-schema", "missing.json"], "cannot read --json-schema"),
        (["--json-schema", "broken.json"], "broken.json: the JSON schema is not valid JSON"),
        (["--json-schema", "unique.json"], 'the JSON schema is not supported: Unimplemented keys: ["uniqueItems"]'),
        (["--regex", "[0-9"], "--regex [0-9: the regular expression is not supported"),
        (["--grammar", "broken.lark"], "broken.lark: the grammar is not supported"),
        (["--regex", "a", "--grammar", "yes_no.gbnf"], "give one of --regex and --grammar"),
    ],
)
def test_run_refuses_a_bad_grammar_before_the_model_loads(files, args, words):
    args = [str(files / a) if a.endswith((".json", ".lark", ".gbnf")) else a for a in args]
    out = llamaterm("run", *args, "--model", "no-such-model", "hi")
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert out.stderr.startswith("llamaterm: ") and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, grammar",
    [
        (["--json-schema", "city.json"], Grammar("json_schema", json.dumps(CITY))),
        (["--regex", "[0-9]+"], Grammar("regex", "[0-9]+")),
        (["--grammar", "yes_no.gbnf"], Grammar("lark", gbnf_to_lark('root ::= "yes" | "no"'))),
    ],
)
def test_run_on_a_server_sends_the_grammar(fake, client, files, args, grammar):
    args = [str(files / a) if a.endswith((".json", ".gbnf")) else a for a in args]
    out = llamaterm("run", "--server", str(client.base_url), "--model", "m", *args, "hi")
    assert out.returncode == 0, out.stderr
    assert fake.submitted[-1][1].grammar == grammar


@pytest.mark.slow
def test_run_json_schema_replies_with_json_the_schema_validates(files):
    question = "What is the capital of France?"
    out = llamaterm("run", "--json-schema", str(files / "city.json"), "--max-tokens", "48", question)
    assert out.returncode == 0, out.stderr
    assert "Paris" in Capital.model_validate_json(out.stdout).capital
