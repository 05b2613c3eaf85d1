"""Chat templates: a model's Jinja template turns a list of messages into its prompt text.

Templates come from model files, so they are untrusted code: they render in jinja2's immutable sandbox,
with the environment Hugging Face transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`tojson`, `raise_exception`, `strftime_now`, `{% generation %}` blocks), so they render here as there.
"""

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamaterm.engine.errors import ModelFormatError, RequestError

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


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute: str):
        # jinja's sandbox answers an unsafe attribute with an Undefined that prints as "" and fails only when used
        # further; a template reaching for internals is hostile, so it fails at once
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template; a template that does not parse fails here, with ModelFormatError."""

    def __init__(self, source: str):
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ModelFormatError(
                f"the model's chat template does not parse (line {err.lineno}): {err.message}"
            ) from err

    def render(self, messages: list[dict], *, add_generation_prompt: bool, bos_token: str, eos_token: str) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                # Templates test `tools is not none`; an undefined variable would pass that test
                tools=None,
                documents=None,
            )
        except _TemplateRaised as err:
            raise RequestError(f"the model's chat template refuses this conversation: {err.message}") from err
        except Exception as err:  # untrusted code can fail in any way (TypeError, SecurityError, ...)
            raise ModelFormatError(f"the model's chat template failed: {type(err).__name__}: {err}") from err
