"""Chat templates: a model's Jinja template turns a list of messages into its prompt text.

Templates come from model files, so they are untrusted code: they render in jinja2's immutable sandbox,
with the environment Hugging Face transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`tojson`, `raise_exception`, `strftime_now`, `{% generation %}` blocks), so they render here as there.

The sandbox stops attribute tricks, not a template that never ends: each render also has a budget. The output
may hold MAX_OUTPUT_CHARS; `*`, `+`, `**` and `%` refuse results beyond it before computing them (they are taken
out of jinja's compile-time constant folding too), and so do the filters and string methods that can make a value
many times larger than what they are given (a width, a separator, a replacement: one C call each, which no time
limit can stop); no filter or method may return a value beyond it. A trace function stops a render that runs past
MAX_RENDER_S (the loops of a template are Python loops in its compiled code, so its frames see every turn).
"""

import functools
import json
import re
import sys
import time
from collections.abc import Sized
from datetime import datetime

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamaterm.engine.errors import ModelFormatError, RequestError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are a few kB
MAX_OUTPUT_CHARS = 1 << 24  # 16M characters: more than any model's context holds as text
MAX_INT_BITS = 1 << 16  # integers a template may compute (Python prints at most 4300 digits anyway)
MAX_RENDER_S = 2.0  # real templates render in milliseconds
MAX_INDENT = 64  # tojson's indent: real templates use 2 or 4

# Used when a model ships no template: ChatML, the format of transformers' old default template. A model not
# trained on it still gets a readable prompt, but its markers are plain text to it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(): it refuses the conversation it was given."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' version: jinja's own tojson HTML-escapes, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}` marks assistant text for training masks; here its body just renders."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


class _OverBudget(jinja2.TemplateError):
    """The template asked for more output, a bigger number or more time than any prompt needs."""


def _size(x) -> int | None:
    """How much room a value takes: characters or items of a sequence, bits of an integer."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x.bit_length()
    return len(x) if isinstance(x, str | list | tuple) else None


def _check_size(what: str, size: int, limit: int = MAX_OUTPUT_CHARS) -> None:
    if size > limit:
        raise _OverBudget(f"{what} would make a value of size {size}, beyond the limit of {limit}")


def _format_bound(fmt: str, args) -> int:
    """At most how long `fmt % args` or `fmt.format(*args)` is: the format, the widths and precisions spelled in it,
    the arguments' lengths, and with `*` widths (`%*s`) the integer arguments too."""
    args = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple | list) else [args]
    size = len(fmt) + sum(int(n) for n in re.findall(r"\d+", fmt))
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool):
            size += a if "*" in fmt and a > 0 else 32
        else:
            size += len(a) if isinstance(a, str | list | tuple | dict) else 32
    return size


def _check_call(name: str, target, args: tuple, kwargs: dict, method: bool) -> None:
    """Refuse a call whose result would pass MAX_OUTPUT_CHARS: of the method `name` of `target` (method=True), or
    of the filter `name` on the value `target`."""
    arg = functools.partial(_arg, args, kwargs)
    what = f"{name}()"
    if name in ("format", "format_map"):  # their integer arguments are values, not sizes
        if isinstance(target, str):
            values = arg(0, "", {}) if name == "format_map" else (*args, *kwargs.values())
            _check_size(what, _format_bound(target, values))
        return
    for value in (*args, *kwargs.values()):  # a width, a count, a number of rows: a size
        if isinstance(value, int) and not isinstance(value, bool):
            _check_size(what, value)
    if name == "tojson":  # its indent comes again on every line, at every depth
        indent = arg(1, "indent")
        _check_size("tojson()'s indent", len(indent) if isinstance(indent, str) else int(indent or 0), MAX_INDENT)
    if name == "join":  # str.join(items) on a separator, or the filter join(items, separator)
        sep, items = (target, arg(0, "iterable")) if method else (arg(0, "d", ""), target)
        if isinstance(sep, str) and isinstance(items, Sized):
            chars = len(items) if isinstance(items, str) else sum(len(x) for x in items if isinstance(x, str))  # type: ignore
            _check_size(what, len(sep) * len(items) + chars)
    elif name in _TEXT_BOUNDS and isinstance(target, str):
        _check_size(what, _TEXT_BOUNDS[name](target, arg))


def _arg(args: tuple, kwargs: dict, i: int, key: str, default=None):
    """A call's argument, given at position i or by its name."""
    return args[i] if len(args) > i else kwargs.get(key, default)


def _replace_bound(text: str, arg) -> int:
    old, new, count = str(arg(0, "old", "")), str(arg(1, "new", "")), arg(2, "count")
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(0, len(new) - len(old))


def _indent_bound(text: str, arg) -> int:  # the width, a number or a string, at every line
    width = arg(0, "width", 4)
    return len(text) + (len(width) if isinstance(width, str) else int(width or 0)) * (text.count("\n") + 1)


# At most how long a method or filter on a string makes it, from the string and its arguments (arg(i, key, default))
_TEXT_BOUNDS = {
    "replace": _replace_bound,
    "indent": _indent_bound,
    "expandtabs": lambda text, arg: len(text) + int(arg(0, "tabsize", 8) or 0) * text.count("\t"),
    # at worst a wrapstring after every character
    "wordwrap": lambda text, arg: len(text) * (1 + len(str(arg(2, "wrapstring") or "\n"))),
}


def _checked(name: str, result):
    size = _size(result)
    if size is not None and not isinstance(result, int):
        _check_size(f"{name}()", size)
    return result


def _budgeted_filter(name: str, f):
    """The filter `f`, refusing a call (and a result) beyond the budget. jinja passes the context, the environment
    or the eval context first to filters marked for it (functools.wraps keeps the mark)."""
    skip = getattr(f, "jinja_pass_arg", None) is not None

    @functools.wraps(f)
    def run(*args, **kwargs):
        given = args[1:] if skip else args
        _check_call(name, given[0] if given else None, given[1:], kwargs, method=False)
        return _checked(name, f(*args, **kwargs))

    return run


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    def visit_Concat(self, node, frame) -> None:
        # `a ~ b` is not a binop jinja lets the sandbox intercept: check the joined string's length instead
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _CodeGenerator

    def checked_concat(self, joined: str) -> str:
        if len(joined) > MAX_OUTPUT_CHARS:
            raise _OverBudget(f"'~' made a string of {len(joined)} characters, beyond the limit of {MAX_OUTPUT_CHARS}")
        return joined

    def call_binop(self, context, operator: str, left, right):
        a, b = _size(left), _size(right)
        if a is not None and b is not None:
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**" and ints:
                size, limit = (a * right if right > 0 and abs(left) > 1 else 0), MAX_INT_BITS
            elif operator == "*":
                # int * int: bits add up; sequence * n: the length multiplies
                size = a + b if ints else (a * right if isinstance(right, int) else left * b)
                limit = MAX_INT_BITS if ints else MAX_OUTPUT_CHARS
            else:
                size, limit = max(a, b) + 1 if ints else a + b, MAX_INT_BITS if ints else MAX_OUTPUT_CHARS
            if size > limit:
                raise _OverBudget(f"{operator!r} would make a value of size {size}, beyond the limit of {limit}")
        if operator == "%" and isinstance(left, str):
            _check_size("'%'", _format_bound(left, right))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own names: kwargs may hold any other)
        # a method's object: a str for 'x'.center(n); format() is jinja's wrapper around str.format
        method = getattr(__obj, "__wrapped__", __obj)
        name = getattr(method, "__name__", "")
        _check_call(name, getattr(method, "__self__", None), args, kwargs, method=True)
        return _checked(name, super().call(__context, __obj, *args, **kwargs))

    def unsafe_undefined(self, obj, attribute: str):
        # jinja's sandbox answers an unsafe attribute with an Undefined that prints as "" and fails only when used
        # further; a template reaching for internals is hostile, so it fails at once
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.filters.update({name: _budgeted_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template; a template that does not parse fails here, with ModelFormatError."""

    def __init__(self, source: str):
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelFormatError(
                f"the model's chat template is {len(source)} characters long, beyond any real "
                f"template (at most {MAX_TEMPLATE_CHARS}); the file is damaged or hostile"
            )
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ModelFormatError(
                f"the model's chat template does not parse (line {err.lineno}): {err.message}"
            ) from err
        except Exception as err:  # the compiler on hostile input: RecursionError, MemoryError, ...
            raise ModelFormatError(f"the model's chat template does not compile: {type(err).__name__}") from err

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool,
        bos_token: str,
        eos_token: str,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """enable_thinking: the thinking switch of templates that have one (Qwen3's), and reasoning_effort gpt-oss's
        ("low", "medium", "high"); None leaves them undefined, so each template takes its own default. tools:
        OpenAI's function tools ({"type": "function", "function": {...}}), given to the template as transformers'
        apply_chat_template gives them."""
        given = {"enable_thinking": enable_thinking, "reasoning_effort": reasoning_effort}
        switches = {k: v for k, v in given.items() if v is not None}
        chunks = self._template.generate(
            **switches,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            # Templates test `tools is not none`; an undefined variable would pass that test
            tools=tools,
            documents=None,
        )
        try:
            return _within_budget(chunks)
        except _TemplateRaised as err:
            raise RequestError(f"the model's chat template refuses this conversation: {err.message}") from err
        except _OverBudget as err:
            raise ModelFormatError(
                f"the model's chat template was stopped: {err.message}; the template is broken "
                "or hostile (run with --raw to skip it)"
            ) from err
        except Exception as err:  # untrusted code can fail in any way (TypeError, SecurityError, ...)
            raise ModelFormatError(f"the model's chat template failed: {type(err).__name__}: {str(err)[:200]}") from err


def _within_budget(chunks) -> str:
    """Join the rendered chunks, stopping a render that outgrows MAX_OUTPUT_CHARS or outlasts MAX_RENDER_S."""
    deadline = time.monotonic() + MAX_RENDER_S

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _OverBudget(f"it ran for more than {MAX_RENDER_S} s")
        return trace

    parts, size = [], 0
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise _OverBudget(f"its output passed {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(parts)
