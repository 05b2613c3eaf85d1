"""gpt-oss's chat template (tests/data/gpt-oss.jinja) renders in the sandbox as transformers renders it, and its
system message is the harmony spec's example (openai/harmony, docs/format.md)."""

from datetime import datetime

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from tests.support import DATA

SOURCE = (DATA / "gpt-oss.jinja").read_text(encoding="utf-8")
BOS, EOS = "<|startoftext|>", "<|return|>"  # gpt-oss's tokenizer_config.json
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["city"],
        },
    },
}
SHAPES = {  # a parameter of every kind the template writes its own way
    "type": "function",
    "function": {
        "name": "shapes",
        "description": "Takes one of each.",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "default": 3},
                "x": {"type": "number", "description": "A number."},
                "flag": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
                "anything": {"type": "array"},
                "maybe": {"type": "string", "nullable": True},
                "either": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                "kind": {"type": ["string", "null"]},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
            },
        },
    },
}
NO_ARGUMENTS = {"type": "function", "function": {"name": "get_location", "description": "Gets the user's location."}}
TOOLS = [WEATHER, SHAPES, NO_ARGUMENTS]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def call(call_id: str, city: str) -> dict:
    """An assistant's call as transformers' documentation has it (arguments as an object)."""
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def transformers_renders(messages: list[dict], tools=None, add_generation_prompt=True, **switches) -> str:
    want, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=SOURCE,
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS,
        eos_token=EOS,
        **switches,
    )
    return want[0]


CALL_TURN = [  # thinking, a call and its result, no answer yet: the call's thinking stays in the prompt
    {"role": "system", "content": "Be brief."},
    QUESTION,
    {"role": "assistant", "content": "", "thinking": "Need the weather tool.", "tool_calls": [call("c1", "Paris")]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "clear", "celsius": 21}'},
]
RENDER_CASES = {  # name -> (messages, tools, switches, add_generation_prompt)
    "a plain chat": ([{"role": "user", "content": "What is 2 + 2?"}], None, {}, True),
    "a system message": ([{"role": "system", "content": "Use a friendly tone."}, QUESTION], None, {}, True),
    "developer instructions": ([{"role": "developer", "content": "Answer in French."}, QUESTION], None, {}, True),
    "reasoning effort low": ([QUESTION], None, {"reasoning_effort": "low"}, True),
    "reasoning effort high": ([QUESTION], None, {"reasoning_effort": "high"}, True),
    "earlier thinking": (
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4.", "thinking": "Simple arithmetic."},
            {"role": "user", "content": "And 9 / 2?"},
        ],
        None,
        {},
        True,
    ),
    "the last reply's thinking (training)": (
        [QUESTION, {"role": "assistant", "content": "Sunny.", "thinking": "Look it up."}],
        None,
        {},
        False,
    ),
    "tools": ([{"role": "system", "content": "Be brief."}, QUESTION], TOOLS, {"reasoning_effort": "high"}, True),
    "a call and its result": (CALL_TURN, TOOLS, {}, True),
    "a call, its result and the answer": (
        [*CALL_TURN, {"role": "assistant", "content": "Clear, 21 °C."}, {"role": "user", "content": "And Oslo?"}],
        TOOLS,
        {},
        True,
    ),
}


@pytest.mark.parametrize("name", list(RENDER_CASES))
def test_the_template_renders_in_the_sandbox_as_transformers_renders_it(name):
    messages, tools, switches, generation = RENDER_CASES[name]
    got = ChatTemplate(SOURCE).render(
        messages, add_generation_prompt=generation, bos_token=BOS, eos_token=EOS, tools=tools, **switches
    )
    assert got == transformers_renders(messages, tools, generation, **switches)
    assert f"Reasoning: {switches.get('reasoning_effort', 'medium')}\n" in got


def test_the_system_message_is_the_specs_example():
    """The spec's "most basic system message you should use if you define functions", on today's date."""
    spec = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    ).replace("2025-06-28", datetime.now().strftime("%Y-%m-%d"))
    got = ChatTemplate(SOURCE).render(
        [QUESTION], add_generation_prompt=True, bos_token=BOS, eos_token=EOS, tools=TOOLS, reasoning_effort="high"
    )
    assert got.startswith(spec)
