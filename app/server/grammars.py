"""The grammar a reply must match, from a request's fields: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, SGLang's regex and ebnf (engine/serving/grammar.py compiles it)."""

from __future__ import annotations

import json

from llamaterm.app.server.errors import APIError
from llamaterm.engine.errors import RequestError
from llamaterm.engine.sampling_params import Grammar
from llamaterm.engine.serving import grammar

# Fields that constrain the reply to a grammar: OpenAI's response_format; vLLM's structured_outputs and, from
# before vLLM 0.12, its guided_* fields; SGLang's regex and ebnf. One a request, at most
GRAMMAR_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "regex",
    "ebnf",
)
# What each of vLLM's and SGLang's fields holds (structured_outputs: one of these keys)
CONSTRAINTS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",
    "ebnf": "grammar",
}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")


def parse_grammar(body: dict) -> tuple[Grammar | None, str | None]:
    """The grammar the body's fields ask for (None: none), and the field that asks."""
    found = [(name, field_grammar(name, body[name])) for name in GRAMMAR_FIELDS if body.get(name) is not None]
    found = [(name, g) for name, g in found if g is not None]
    if len(found) > 1:
        names, second = " and ".join(name for name, _ in found), found[1][0]
        raise APIError(400, f"{second}: {names} each constrain the reply: give one of them", second)
    return (found[0][1], found[0][0]) if found else (None, None)


def field_grammar(field: str, value: object) -> Grammar | None:
    try:
        if field == "response_format":
            return response_format_grammar(value)
        if field == "structured_outputs":
            return structured_outputs_grammar(value)
        return constraint(CONSTRAINTS[field], value)
    except RequestError as e:
        raise APIError(400, f"{field}: {e}", field) from None


def response_format_grammar(value: object) -> Grammar | None:
    """OpenAI's response_format: {"type": "text"} (free), {"type": "json_object"} (any JSON object) or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. strict or not, the
    schema is enforced: every token is sampled within it."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json")
    spec = value.get("json_schema") if isinstance(value, dict) and kind == "json_schema" else None
    if not isinstance(spec, dict):
        raise RequestError(
            'give {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": '
            '..., "schema": {...}}}'
        )
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("strict", False), bool | None):
        raise RequestError("json_schema takes a name (a string), a schema (an object) and strict (true or false)")
    schema = spec.get("schema")
    if schema is None:
        return Grammar("json")
    if not isinstance(schema, dict):
        raise RequestError("json_schema.schema must be a JSON Schema object")
    return Grammar("json_schema", json.dumps(schema))


def structured_outputs_grammar(value: object) -> Grammar:
    """vLLM's structured_outputs: an object with one of json, regex, choice, grammar or json_object."""
    if not isinstance(value, dict):
        value = {}
    given = [k for k, v in value.items() if v is not None]
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUTS:
        raise RequestError(f"give an object with one of {', '.join(STRUCTURED_OUTPUTS)}")
    if given[0] == "json_object":
        if value["json_object"] is not True:
            raise RequestError("json_object must be true")
        return Grammar("json")
    return constraint(given[0], value[given[0]], f"{given[0]} ")


def constraint(kind: str, value: object, where: str = "") -> Grammar:
    """A JSON schema (an object, or its text), a regular expression, a choice of strings, or a grammar (Lark, or
    llama.cpp's GBNF) as vLLM and SGLang take them."""
    if kind == "json" and isinstance(value, dict | str):
        return Grammar("json_schema", value if isinstance(value, str) else json.dumps(value))
    if kind == "regex" and isinstance(value, str):
        return Grammar("regex", value)
    if kind == "choice" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return grammar.choice(value)
    if kind == "grammar" and isinstance(value, str):
        return grammar.lark_from_ebnf(value)
    shapes = {
        "json": "a JSON schema (an object, or its text)",
        "regex": "a regular expression (a string)",
        "choice": "an array of strings",
        "grammar": "a grammar (a string: Lark or GBNF)",
    }
    raise RequestError(f"{where}must be {shapes[kind]}")


def check_grammar(wanted: Grammar, field: str | None) -> None:
    """Refuse a grammar llguidance cannot compile as a 400 naming its field (run in the thread pool: a large
    schema takes milliseconds, and the first of a kind more)."""
    try:
        grammar.check(wanted)
    except RequestError as e:
        raise APIError(400, f"{field}: {e}", field) from None
