"""What a user hands the CLI: prompts (an argument or stdin), files, and the grammar a reply must match, each read
and checked here, so bad input is one line naming it (exit code 2) before any model loads. No torch."""

import os
import sys
from pathlib import Path

from llamaterm.app.console import fail, interrupts_held


def read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            fail("give a PROMPT, or pipe one on stdin (see llamaterm run --help)", 2)
        return as_text(sys.stdin.buffer.read(), "stdin")
    return as_text(os.fsencode(prompt), "the prompt")  # argv's undecodable bytes come as surrogates: find them


def read_file(path: Path, option: str = "--file") -> str:
    try:
        data = path.read_bytes()
    except OSError as e:  # missing, a directory, unreadable
        fail(f"cannot read {option} {path}: {e.strerror or e}", 2)
    return as_text(data, str(path))


def reply_grammar(json_schema: Path | None, regex: str | None, grammar_file: Path | None):
    """The Grammar the reply must match (--json-schema, --regex or --grammar), checked; None without one."""
    given = [o for o, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar_file)) if v]
    if len(given) > 1:
        fail(f"give one of {' and '.join(given)}: a reply follows one grammar", 2)
    if not given:
        return None
    with interrupts_held():
        from llamaterm.engine.errors import RequestError
        from llamaterm.engine.sampling_params import Grammar
        from llamaterm.engine.serving import grammar

    try:
        if json_schema:
            wanted = Grammar("json_schema", read_file(json_schema, "--json-schema"))
        elif grammar_file:
            wanted = grammar.lark_from_ebnf(read_file(grammar_file, "--grammar"))
        else:
            wanted = Grammar("regex", regex or "")
        grammar.check(wanted)
    except RequestError as e:
        fail(f"{given[0]} {json_schema or grammar_file or regex}: {e}", 2)
    return wanted


def as_text(data: bytes, source: str) -> str:
    """Prompts are UTF-8 text; anything else (binary data, another encoding) is refused by name."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{source} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}): give text prompts", 2)
