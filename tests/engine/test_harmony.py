"""Harmony, gpt-oss's chat format (engine/harmony.py, and where it meets thinking.py, tool_calls.py and the
tokenizer): its template renders as transformers renders it, replies read into thinking, answer and calls, its
vocabulary stops where gpt-oss stops, and a forced call's grammar takes harmony's call syntax only.

Oracles: transformers' rendering of gpt-oss's real chat template (tests/data/gpt-oss.jinja); the harmony spec's own
examples (openai/harmony, docs/format.md); the test vectors of llama.cpp's gpt-oss parser (tests/test-chat.cpp of
the llama.cpp sources in llama-cpp-python's sdist, the one `make test` fetches for the converter) and that
converter, which writes the GGUF of a vocabulary with harmony's special tokens; llguidance's own matcher."""

import json
from datetime import datetime
from pathlib import Path

import llguidance
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from llamaterm.engine import harmony
from llamaterm.engine.checkpoints.chat_template import ChatTemplate
from llamaterm.engine.checkpoints.gguf import read_gguf_file
from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.thinking import ThinkingSplitter, split_reply
from llamaterm.engine.tool_calls import HARMONY, ToolCallStream, ToolFormat, call_grammar, for_template, parse_reply
from llamaterm.engine.tool_calls import tool_format as tool_format_of
from tests.support import DATA
from tests.support.family_oracle import convert_to_gguf
from tests.support.tokenizer_files import harmony_files

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


def openai_form(messages: list[dict]) -> list[dict]:
    """The conversation as an OpenAI client sends it: the calls' arguments as JSON text."""
    out = []
    for m in messages:
        calls = [
            c | {"function": c["function"] | {"arguments": json.dumps(c["function"]["arguments"])}}
            for c in m.get("tool_calls", [])
        ]
        out.append(m | {"tool_calls": calls} if calls else m)
    return out


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


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return harmony_files(tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def tokenizers(folder) -> tuple[Tokenizer, Tokenizer]:
    """A harmony vocabulary read from its tokenizer.json folder and from the GGUF llama.cpp's converter makes of it."""
    gguf = convert_to_gguf(folder, folder / "vocab.gguf", pre="gpt-4o", vocab_only=True)
    return Tokenizer.from_hf_dir(folder), Tokenizer.from_gguf_metadata(read_gguf_file(gguf).metadata)


@pytest.fixture(scope="module")
def tok(tokenizers) -> Tokenizer:
    return tokenizers[0]


def test_its_tools_are_native_and_its_family_harmony():
    assert tool_format_of(ChatTemplate(SOURCE)) == ToolFormat(HARMONY, native=True)


def test_an_openai_conversation_with_calls_renders_as_transformers_renders_it(tok):
    """As `serve` sends it: the calls' arguments as JSON text, the call's thinking in a <think> block of its content
    (the form serve gives it back in), the tools' replies."""
    messages = openai_form(CALL_TURN)
    del messages[2]["thinking"]
    messages[2]["content"] = "<think>Need the weather tool.</think>"
    shaped, tools = for_template(messages, TOOLS, tool_format_of(tok.chat_template))
    assert tok.apply_chat_template(shaped, tools=tools) == transformers_renders(CALL_TURN, TOOLS)


THOUGHT = "Need the weather tool."
CALL_REPLIES = {  # an earlier call's reply, with its thinking, as each kind of client gives it back
    "thinking (transformers' field)": {"content": "", "thinking": THOUGHT},
    "reasoning_content (vLLM's field)": {"content": "", "reasoning_content": THOUGHT},
    "a <think> block (serve's form)": {"content": f"<think>{THOUGHT}</think>"},
    "harmony's markup (the engine's text, as the TUI keeps it)": {
        "content": f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
    },
    "a preamble beside the thinking": {"content": "Checking.", "thinking": THOUGHT},  # the template takes one
}


@pytest.mark.parametrize("name", list(CALL_REPLIES))
def test_an_earlier_calls_thinking_reaches_the_template(tok, name):
    reply = {"role": "assistant", "tool_calls": [call("c1", "Paris")]} | CALL_REPLIES[name]
    conversation = [QUESTION, reply, CALL_TURN[3]]
    thought = THOUGHT + ("\n\nChecking." if "Checking." in reply["content"] else "")
    oracle = [QUESTION, {"role": "assistant", "content": "", "thinking": thought, "tool_calls": [call("c1", "Paris")]}]
    want = transformers_renders([*oracle, CALL_TURN[3]], TOOLS)
    assert tok.apply_chat_template(conversation, tools=TOOLS) == want
    assert f"<|channel|>analysis<|message|>{thought}<|end|>" in want


def test_an_earlier_answer_in_harmonys_markup_is_its_final_message(tok):
    """The TUI sends its replies back as the engine streamed them: the answer goes to the template, not the markup
    (which the template refuses in content)."""
    raw = "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>4."
    chat = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": raw}, QUESTION]
    oracle = [chat[0], {"role": "assistant", "content": "4.", "thinking": "Simple arithmetic."}, QUESTION]
    assert tok.apply_chat_template(chat) == transformers_renders(oracle)


def test_several_calls_in_one_message_become_one_a_message_each_before_its_reply(tok):
    """gpt-oss's template renders a message's first call only and names replies after the last call."""
    both = {"role": "assistant", "content": "", "thinking": "Two cities.", "tool_calls": [call("a", "Paris")]}
    both["tool_calls"].append(call("b", "Oslo"))
    replies = [
        {"role": "tool", "tool_call_id": "b", "content": "cold"},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    oracle = [
        QUESTION,
        {"role": "assistant", "content": "", "thinking": "Two cities.", "tool_calls": [call("a", "Paris")]},
        replies[1],
        {"role": "assistant", "content": "", "tool_calls": [call("b", "Oslo")]},
        replies[0],
    ]
    shaped, tools = for_template(openai_form([QUESTION, both, *replies]), TOOLS, ToolFormat(HARMONY, True))
    assert tok.apply_chat_template(shaped, tools=tools) == transformers_renders(oracle, TOOLS)


def test_the_prompt_is_the_ids_of_transformers_rendering(tokenizers):
    """Markers as the special tokens they are; the prompt ends with <|start|>assistant, where the reply begins."""
    want = transformers_renders(CALL_TURN, TOOLS)
    for tok in tokenizers:
        ids = tok.encode_chat(CALL_TURN, tools=TOOLS)
        assert tok.decode(ids) == want
        start = tok.token_id("<|start|>")
        assert ids.count(start) == want.count("<|start|>") == 7  # system, developer, user, thinking, call, result, ...
        assert tok.decode(ids[len(ids) - ids[::-1].index(start) - 1 :]) == "<|start|>assistant"  # ... the reply's


# ---- reading replies ----

HELLO = "Hello, world!\nWhat's up?"
ARG1 = [("special_function", '{"arg1": 1}')]
EDIT = '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}'
PLAN = (
    "**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for the Node.js server\n3. Start the server"
)
PLAN += "\n---\nWill start executing the plan step by step"
READ_CASES = [  # (reply after the prompt's <|start|>assistant, thinking, answer, calls)
    # llama.cpp's vectors for its gpt-oss parser (tests/test-chat.cpp)
    (f"<|channel|>final<|message|>{HELLO}", "", HELLO, []),
    (f"<|channel|>commentary<|message|>{HELLO}", "", HELLO, []),  # a preamble: for the user
    (f"<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>{HELLO}",)
    + ("I'm\nthinking", HELLO, []),
    ("<|channel|>analysis<|message|>I'm\nthinking", "I'm\nthinking", "", []),  # cut short
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", ARG1),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "", ARG1),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "", ARG1),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "", ARG1),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
        "I'm\nthinking",
        "",
        ARG1,
    ),
    (
        "<|channel|>analysis<|message|>Thinking about edit...<|end|>"
        f"<|start|>assistant<|channel|>commentary to=functions.edit <|constrain|>json<|message|>{EDIT}",
        "Thinking about edit...",
        "",
        [("edit", EDIT)],
    ),
    (
        "<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
        '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
        "I need to output the invoice details in JSON",
        '{"amount": 123.45, "date": "2025-12-03"}',
        [],
    ),
    (  # calls to built-in tools the model was not given: nobody's text
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
        "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
        "I will execute python to say hello",
        "",
        [],
    ),
    (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
        '<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
        "I will execute python to say hello",
        "",
        [],
    ),
    (  # a stray commentary header before the real one (gpt-oss-20b)
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{HELLO}",
        "I'm\nthinking",
        HELLO,
        [],
    ),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        f"<|start|>assistant<|channel|>commentary to=assistant<|channel|>final<|message|>{HELLO}",
        "I'm\nthinking",
        HELLO,
        [],
    ),
    # the spec's examples (docs/format.md), with their stop tokens, which the engine keeps out of the text
    (
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
        "2 + 2 = 4.",
        [],
    ),
    (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
        "Need to use function get_weather.",
        "",
        [("get_weather", '{"location":"San Francisco"}')],
    ),
    (
        "<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary"
        f"<|message|>{PLAN}<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>"
        'json<|message|>{"template": "basic_html", "path": "index.html"}<|call|>',
        "{long chain of thought}",
        PLAN,
        [("generate_file", '{"template": "basic_html", "path": "index.html"}')],
    ),
    # thinking around a message to a tool it was not given; two messages of a part read with a blank line between
    (
        "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis to=python<|message|>1 + 1"
        "<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|><|start|>assistant<|channel|>final<|message|>C",
        "A\n\nB",
        "C",
        [],
    ),
    # text that is no harmony message (a reply a grammar forced into JSON) is the answer
    ('{"city": "Paris"}', "", '{"city": "Paris"}', []),
]


def split_stream(pieces: list[str]) -> tuple[str, str]:
    split, thinking, answer = ThinkingSplitter(), "", ""
    for piece in [*pieces, None]:
        t, a = split.finish() if piece is None else split.push(piece)
        thinking, answer = thinking + t, answer + a
    return thinking, answer


def call_stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The reply through ToolCallStream as OpenAI's client gathers it: (content, [(name, arguments)])."""
    stream, content, calls = ToolCallStream(HARMONY), "", {}
    for i, piece in enumerate([*pieces, ""]):
        text, deltas = stream.push(piece, final=i == len(pieces))
        content += text
        for d in deltas:
            found = calls.setdefault(d.index, {"name": "", "arguments": ""})
            found["name"] += d.name or ""
            found["arguments"] += d.arguments
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("reply, thinking, answer, calls", READ_CASES)
def test_replies_read_whole_and_streamed_in_every_cut(reply, thinking, answer, calls):
    content, got = parse_reply(reply, HARMONY)
    assert [(c.name, c.arguments) for c in got] == calls
    assert split_reply(content or "") == (thinking, answer)  # the thinking goes in a <think> block of the content
    if not reply.startswith(" to="):  # (a reply that opens with a call comes where calls are read: serve's)
        assert split_reply(reply) == (thinking, answer)
    for cut in range(1, len(reply)):
        assert call_stream([reply[:cut], reply[cut:]]) == (content or "", calls), cut
        if not reply.startswith(" to="):
            assert split_stream([reply[:cut], reply[cut:]]) == (thinking, answer), cut


def test_a_reply_read_without_its_calls_keeps_its_thinking_and_answer():
    reply = next(case[0] for case in READ_CASES if "generate_file" in case[0])  # the spec's preamble and call
    stream = ToolCallStream(HARMONY, read_calls=False)
    content, deltas = stream.push(reply, final=True)
    assert split_reply(content) == ("{long chain of thought}", PLAN) and deltas == []


def test_the_splitter_says_when_it_is_thinking():
    """The TUI labels a reply "Thinking…" while its analysis streams."""
    split = ThinkingSplitter()
    assert split.push("<|channel|>analysis<|message|>Hm") == ("Hm", "") and split.state == "thinking"
    assert split.push("<|end|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")
    assert split.state == "answer" and split.thinks


# ---- the vocabulary ----


@pytest.mark.parametrize("source", ["tokenizer.json", "gguf"])
def test_return_and_call_end_a_reply_and_end_does_not(tokenizers, source):
    """<|return|> is the EOS, <|call|> ends a reply that calls a tool; <|end|>, which ends other families' turns
    (Phi-3's), ends only a message in harmony, as llama.cpp decides it for this vocabulary."""
    tok = tokenizers[source == "gguf"]
    assert tok.token_text(tok.eos_id) == "<|return|>"
    assert {tok.token_text(i) for i in tok.stop_ids} == {"<|return|>", "<|call|>", "<|endoftext|>"}


@pytest.mark.parametrize("source", ["tokenizer.json", "gguf"])
def test_the_detokenizer_writes_the_markers_the_reader_needs(tokenizers, source):
    tok = tokenizers[source == "gguf"]
    reply = READ_CASES[2][0]
    ids = tok.encode(reply, add_special=False, parse_special=True)
    assert ids[0] == tok.token_id("<|channel|>") and len(ids) < len(reply) // 2  # markers are one token each
    detok = tok.detokenizer()
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == reply
    assert split_stream(deltas) == ("I'm\nthinking", HELLO)


# ---- forced calls ----


@pytest.fixture(scope="module")
def lltok(folder) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(str(folder / "tokenizer.json"))


def matches(lltok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher takes the text's tokens one by one and may then end."""
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = lltok.tokenize_str(text, parse_special=True)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


PARIS = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
THINK = "<|channel|>analysis<|message|>Need the weather: <|x|> is text.<|end|><|start|>assistant"


@pytest.mark.parametrize(
    "name, text, ok",
    [
        (None, PARIS, True),
        (None, THINK + PARIS, True),  # thinking first
        (None, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + PARIS, True),  # a preamble
        (None, THINK.replace("is text", "<|start|>") + PARIS, False),  # no special token inside a message
        (None, "<|channel|>commentary to=functions.get_location <|constrain|>json<|message|>{}", True),
        (None, PARIS.replace('"city"', '"town"'), False),  # not the tool's schema
        (None, PARIS.replace("get_weather", "rm_rf"), False),  # not a tool
        (None, "<|channel|>final<|message|>Sunny.", False),  # an answer, where a call is required
        (None, THINK, False),  # thinking alone
        ("get_location", PARIS, False),  # not the tool named
        ("get_weather", THINK + PARIS, True),
    ],
)
def test_a_forced_calls_grammar_takes_harmonys_call_syntax(tok, lltok, name, text, ok):
    grammar = call_grammar(ToolFormat(HARMONY, True), TOOLS, name, False, tok.token_id)
    assert grammar.kind == "lark" and f"<[{tok.token_id('<|channel|>')}]>" in grammar.text  # markers by their ids
    assert matches(lltok, grammar.text, text) == ok
    if ok:
        assert [c.name for c in parse_reply(text, HARMONY)[1]] == [name or text.split("functions.")[1].split()[0]]


def test_a_harmony_template_is_told_by_its_channels():
    assert harmony.speaks_harmony(SOURCE) and not harmony.speaks_harmony((DATA / "qwen3-0.6b.jinja").read_text())
