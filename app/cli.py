"""The `llamaterm` command line. Start-up stays instant: torch and the engine load only inside commands."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from llamaterm.app import bench, models_cli, servers_cli
from llamaterm.app.console import echo, fail, imports_frozen, interrupts_held, say, startup_split
from llamaterm.app.engine_flags import EngineFlags, engine_flags
from llamaterm.app.inputs import read_file, read_prompt, reply_grammar
from llamaterm.app.replies import Reply, collect, report, show_thinking
from llamaterm.app.terminal import shown


class Commands(TyperGroup):
    """Typer's group, whose help shows no type beside a flag: Typer writes `<bool>` there, where a flag takes no
    value. (Every command's parameters pass through get_command and get_params on their way to the help.)"""

    def get_command(self, ctx, cmd_name: str):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            untyped_flags([*command.params, command.get_help_option(ctx)])
        return command

    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))


def untyped_flags(params: list) -> list:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


app = typer.Typer(
    name="llamaterm",
    cls=Commands,
    help="Run local LLMs (Llama, Qwen, Phi, Gemma, Mistral) from the terminal.\n\nExamples:\n\n"
    '  llamaterm run "What is the capital of France?"\n\n'
    "  echo 'Summarise: ...' | llamaterm run -\n\n"
    "  llamaterm chat --sessions 4",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command's too
    pretty_exceptions_enable=False,
)


def show_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"llamaterm {version('llamaterm')}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool | None,
        typer.Option("--version", "-V", callback=show_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """Run local LLMs (Llama, Qwen, Phi, Gemma, Mistral) from the terminal."""


ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model name in the store, or a path.", autocompletion=models_cli.complete_model),
]
ServerOpt = Annotated[
    str | None,
    typer.Option(
        help="An OpenAI-compatible server (llamaterm serve, vLLM, SGLang, llama.cpp) to use instead of a local model, "
        "e.g. http://127.0.0.1:8000/v1; --model then names one of its models."
    ),
]
ApiKeyOpt = Annotated[str | None, typer.Option(envvar="LLAMATERM_API_KEY", help="The server's API key.")]
LocalOpt = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Load the model here, even where a `llamaterm serve` on this machine holds it (which is used by default; "
        "--kv-tokens, --ctx, --gpu-memory, --threads and --speculate shape a local engine, and imply it).",
    ),
]
PresetOpt = Annotated[
    str | None,
    typer.Option(
        help="A preset's system prompt and sampling values (`llamaterm presets` lists them); flags given win.",
        show_default=False,
    ),
]


def preset_named(name: str | None):
    """The preset --preset names (None: no preset), checked."""
    if name is None:
        return None
    from llamaterm.app.presets import PresetError, find_preset

    try:
        return find_preset(name)
    except PresetError as e:
        fail(str(e), 2)


def with_preset(name: str | None, system: str | None, default_max_tokens: int, **given) -> tuple[str | None, dict]:
    """The system prompt and sampling values a command runs with: what the user gave (None: not given), --preset's
    where the user gave none, and the command's default_max_tokens where neither did; checked."""
    preset = preset_named(name)
    if preset is not None:
        system = preset.system if system is None else system
        given = preset.fill(given)
    if given["max_tokens"] is None:
        given = given | {"max_tokens": default_max_tokens}
    return system, checked_sampling(**given)


def checked_sampling(**given) -> dict:
    """The sampling values the user gave (None: not given), checked now: a bad flag value is a usage error, before
    any model loads."""
    from llamaterm.engine.errors import RequestError
    from llamaterm.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**{k: v for k, v in given.items() if v is not None})
    except RequestError as e:
        fail(str(e), 2)
    return given


def model_sampling(engine, given: dict):
    """SamplingParams of the user's values, the engine's model's defaults for the rest (a server's own, for a
    remote one); what was wrong in the model's files goes to stderr."""
    defaults = engine.sampling_defaults
    for warning in defaults.warnings:
        say(f"llamaterm: warning: {warning}")
    return defaults.params(given)


def load_engine(
    model: str | None,
    device: str | None,
    shape: dict,
    server: str | None = None,
    api_key: str | None = None,
    sessions: int = 1,
    local: bool = False,
    verbose: bool = False,
):
    """With --server, that server's `model` (None: its first). Else a `llamaterm serve` on this machine that holds
    `model` (app/announcements.py), unless `local` or `shape` (EngineFlags.shape(): --kv-tokens, --ctx,
    --speculate, ...), which shape a local engine, say otherwise; else the local engine on `model` for `sessions`
    requests at a time (so start-up prepares no more). verbose: say which, and where a local start-up's time went."""
    if server:
        from llamaterm.app.remote import RemoteEngine

        return RemoteEngine(server, model, api_key)
    note = (lambda message: say(f"llamaterm: {message}")) if verbose else (lambda message: None)
    if not local and not shape:
        from llamaterm.app.announcements import find_server

        found = find_server(model, device, note)
        if found is not None:
            return found
        note(f"no server on this machine holds {model or 'the default model'}: loading it here")
    t = time.perf_counter()
    with interrupts_held(), imports_frozen():
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.engine import Engine
    imports = time.perf_counter() - t
    config = EngineConfig(model=model, device=device, max_running=min(64, sessions), **shape)
    engine = Engine.from_model(config)
    startup = startup_split({"imports": imports, **engine.core.startup_s})
    note(f"{engine.model_name} on {engine.device}: start-up {startup}")
    return engine


def messages_for(prompt: str, system: str | None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def result_json(engine, reply: Reply, handle, logprobs: bool = False) -> dict:
    """--json's object; with logprobs, each reply token's log-probability and alternatives, as OpenAI's chat
    choice gives them."""
    st = handle.stats()
    shown = {
        "model": engine.model_name,
        "text": reply.text,
        "thinking": reply.thinking,
        "finish_reason": reply.finish_reason,
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "generated_tokens": st.generated_tokens,
        "token_ids": reply.token_ids,
        "ttft_s": st.ttft_s,
        "tokens_per_s": st.tokens_per_s,
    }
    if logprobs:
        from llamaterm.app.logprobs import logprobs_json

        shown["logprobs"] = logprobs_json(engine, reply.logprobs)
    return shown


@app.command()
@engine_flags
def run(
    prompt: Annotated[str | None, typer.Argument(help="The prompt; '-' or none reads stdin.")] = None,
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    preset: PresetOpt = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Most tokens to generate. Default: 512.", show_default=False)
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy. Default: the model's (see info).")] = None,
    top_p: Annotated[float | None, typer.Option(help="1 is off. Default: the model's.")] = None,
    top_k: Annotated[int | None, typer.Option(help="0 is off. Default: the model's.")] = None,
    min_p: Annotated[float | None, typer.Option(help="0 is off. Default: the model's.")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(help="1 is off. Default: the model's.")] = None,
    presence_penalty: Annotated[float | None, typer.Option(help="0 is off. Default: the model's.")] = None,
    frequency_penalty: Annotated[float | None, typer.Option(help="0 is off. Default: the model's.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    json_schema: Annotated[
        Path | None, typer.Option(help="A JSON Schema file: the reply is JSON that it validates.")
    ] = None,
    regex: Annotated[str | None, typer.Option(help="A regular expression the whole reply matches.")] = None,
    grammar: Annotated[
        Path | None,
        typer.Option(help="A grammar file (llguidance's Lark syntax, or llama.cpp's GBNF) the reply follows."),
    ] = None,
    raw: Annotated[bool, typer.Option(help="Skip the chat template: the prompt is the model's raw input.")] = False,
    parse_special: Annotated[
        bool,
        typer.Option(
            help="With --raw: special-token text such as <|im_start|> becomes those tokens, as vLLM and llama.cpp's "
            "server read a prompt; --no-parse-special keeps it plain text."
        ),
    ] = True,
    think: Annotated[
        bool | None,
        typer.Option(
            "--think/--no-think",
            help="Turn the chat template's thinking switch on or off (Qwen3's enable_thinking); "
            "default: the template's own.",
            show_default=False,
        ),
    ] = None,
    hide_thinking: Annotated[
        bool,
        typer.Option(
            help="Drop the reply's thinking (<think>...</think>), which otherwise goes to stderr (and to --json's "
            "'thinking')."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object (a line each with --each-line).")] = False,
    logprobs: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=20,
            help="With --json: each reply token's log-probability and its N likeliest alternatives (OpenAI's "
            "logprobs.content).",
            show_default=False,
        ),
    ] = None,
    each_line: Annotated[bool, typer.Option(help="One prompt per line of stdin (or --file), all at once.")] = False,
    file: Annotated[
        Path | None, typer.Option(help="Read the prompt from this file (a prompt per line with --each-line).")
    ] = None,
    flags: EngineFlags = EngineFlags(),
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Say on stderr whether a server on this machine answers (which, or why none) and where a local "
            "start-up's time went.",
        ),
    ] = False,
):
    """Generate a reply to PROMPT and stream it to stdout.

    Examples: llamaterm run "What is the capital of France?"   |   llamaterm run --json --seed 1 --temperature 0.7 "Hi"
    """
    system, given = with_preset(
        preset,
        system,
        512,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=seed,
        stop=tuple(stop or ()),
        grammar=reply_grammar(json_schema, regex, grammar),
        logprobs=logprobs,
    )
    if logprobs is not None and not as_json:  # stdout is the reply's text: the numbers need a shape of their own
        fail("--logprobs goes in the JSON output: add --json", 2)
    if file and prompt is not None:
        fail("give a PROMPT or --file, not both", 2)
    if each_line:
        if prompt not in (None, "-"):
            fail("--each-line reads its prompts one a line from stdin or --file, not from PROMPT", 2)
        if not file and sys.stdin.isatty():
            fail("--each-line reads its prompts one a line from stdin or --file: pipe them in", 2)
        source = read_file(file) if file else read_prompt("-")
        # lines end at newlines only (splitlines would also cut at a form feed or U+2028 inside a prompt)
        prompts = [line.removesuffix("\r") for line in source.split("\n") if line.strip()]
        if not prompts:
            fail("no prompts: --each-line reads one prompt per non-empty line", 2)
    else:
        prompts = [read_file(file) if file else read_prompt(prompt)]
        if not prompts[0].strip():
            fail("the prompt is empty: give some text", 2)
    shape = flags.shape()
    with load_engine(model, flags.device, shape, server, api_key, len(prompts), local, verbose) as engine:
        params = model_sampling(engine, given)
        inputs = [p if raw else messages_for(p, system) for p in prompts]
        handles = [
            engine.submit(x, params, raw=raw, enable_thinking=think, parse_special=parse_special) for x in inputs
        ]
        if each_line:
            for handle in handles:  # input order, though all run at once
                reply = collect(handle, hide_thinking=hide_thinking)
                if reply.thinking and not as_json:
                    show_thinking(reply.thinking + "\n")
                typer.echo(
                    json.dumps(result_json(engine, reply, handle, logprobs is not None))
                    if as_json
                    else shown(reply.text, sys.stdout)
                )
            return
        handle = handles[0]
        if as_json:
            reply = collect(handle, hide_thinking=hide_thinking)
            typer.echo(json.dumps(result_json(engine, reply, handle, logprobs is not None), indent=2))
        else:
            collect(handle, echo=True, hide_thinking=hide_thinking)
            if sys.stderr.isatty():
                report(handle)


@app.command()
@engine_flags
def chat(
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="Model name in the store, or a path; on a --server, one of its models. Repeat it to "
            "put the panes on several models in turn (the TUI).",
            autocompletion=models_cli.complete_model,
        ),
    ] = None,
    sessions: Annotated[int, typer.Option(min=1, max=8, help="Conversation panes side by side.")] = 1,
    system: Annotated[str | None, typer.Option(help="System prompt for every session.")] = None,
    preset: PresetOpt = None,
    plain: Annotated[bool, typer.Option(help="A line-based chat for pipes and dumb terminals.")] = False,
    temperature: Annotated[float | None, typer.Option(help="0 is greedy. Default: the model's.")] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Most tokens a reply takes. Default: 1024.", show_default=False)
    ] = None,
    flags: EngineFlags = EngineFlags(),
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
):
    """Chat with a model: the TUI, or a line chat with --plain.

    Both use a `llamaterm serve` on this machine that holds the model, unless --local. The line chat's /help lists
    its commands; /bye quits.

    Examples: llamaterm chat --sessions 4   |   llamaterm chat --preset coder --ctx 4096   |   llamaterm chat --plain
    """
    system, given = with_preset(preset, system, 1024, temperature=temperature, max_tokens=max_tokens)
    shape = flags.shape()
    if not plain:
        from llamaterm.app.tui.app import run_tui
        from llamaterm.app.tui.backends import Backend, Loader
        from llamaterm.app.tui.session import ChatSettings

        backends = [Backend(m, server or "") for m in models or [""]]
        settings = ChatSettings(system=system or "", **{k: v for k, v in given.items() if v not in (None, ())})
        return run_tui(backends, sessions, settings, Loader(api_key, flags.device, shape, local))
    if models and len(models) > 1:
        fail("--plain chats with one model: give one --model", 2)
    from llamaterm.app.line_chat import LineChat

    with load_engine(models[0] if models else None, flags.device, shape, server, api_key, local=local) as engine:
        for warning in engine.sampling_defaults.warnings:
            say(f"llamaterm: warning: {warning}")
        LineChat(engine, system, given, 1024).run()


@app.command()
@engine_flags
def serve(
    model: ModelOpt = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on; the default takes connections from this machine only.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LLAMATERM_API_KEY",
            help="Refuse /v1 requests and /metrics without this key (sent as 'Authorization: Bearer KEY').",
        ),
    ] = None,
    flags: EngineFlags = EngineFlags(),
    preset: Annotated[
        str | None,
        typer.Option(
            help="A preset (`llamaterm presets`): its sampling values fill what requests leave out, and its system "
            "prompt leads chats that bring none.",
            show_default=False,
        ),
    ] = None,
    keep_alive: Annotated[
        str,
        typer.Option(
            help="Unload the model after this long without a request (30s, 5m, 1h) and load it again for the next "
            "one; 0 keeps it loaded.",
        ),
    ] = "0",
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-origins",
            help="A web page's origin (http://localhost:3000; * for any) whose requests the server answers; a page's "
            "requests from any other origin get 403. Repeat for more.",
            metavar="ORIGIN",
            show_default=False,
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM or Ctrl-C, how long the requests in flight may finish (new ones get 503) before they "
            "end with an error.",
        ),
    ] = 10,
):
    """Serve a model over an OpenAI-compatible HTTP API.

    /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. Requests from every client are batched
    by the one engine. `llamaterm ps` lists the servers running, `llamaterm stop` ends one.

    Examples: llamaterm serve --port 8000, then point any OpenAI client at http://127.0.0.1:8000/v1   |
    llamaterm serve --keep-alive 5m --ctx 4096   |   llamaterm ps   |   llamaterm stop
    """
    if api_key == "":  # not a key at all: serving without one must be asked for by leaving the option out
        fail("--api-key is empty: give a key, or leave the option out to serve without one", 2)
    with interrupts_held():
        from llamaterm.app.announcements import Announcer, served_model
        from llamaterm.app.durations import parse_duration, shown_duration
        from llamaterm.app.server.handlers import LOOPBACK, Service
        from llamaterm.app.server.http_server import check_port
        from llamaterm.app.server.http_server import serve as serve_http
        from llamaterm.app.server.supervisor import EngineSupervisor
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess

    try:
        idle_s = parse_duration(keep_alive)
    except ValueError as e:
        fail(f"--keep-alive: {e}", 2)
    chosen = preset_named(preset)
    shape = flags.shape()

    problem = check_port(host, port)
    if problem:
        fail(f"cannot listen on {host}:{port}: {problem}: choose another --port or --host", 2)
    if api_key is None and host not in LOOPBACK:
        typer.echo(
            f"llamaterm: warning: anyone who reaches {host}:{port} can use the model: consider --api-key", err=True
        )
    config = EngineConfig(model=model, device=flags.device, **shape)
    with EngineSupervisor(lambda: EngineProcess(config)) as supervisor:
        engine = supervisor.engine
        for warning in engine.sampling_defaults.warnings:
            say(f"llamaterm: warning: {warning}")
        kv = engine.info.get("kv_tokens")
        unload = f", unloaded after {shown_duration(idle_s)} idle" if idle_s else ""
        say(
            f"llamaterm serve: {engine.model_name} on {engine.device} at http://{host}:{port}/v1: context "
            f"{engine.max_context}, KV cache {kv} tokens{unload} (Ctrl-C or `llamaterm stop` stops it)"
        )
        # run and chat on this machine find the server by its announcement, once it answers
        announcer = Announcer(host, port, engine.device, [served_model(model, engine.model_name)])
        service = Service(supervisor, idle_s, chosen, tuple(allowed_origins or ()))
        serve_http(service, host, port, api_key, shutdown_timeout, announcer)


servers_cli.register(app)  # ps, stop


@app.command()
def tokenize(
    text: Annotated[str, typer.Argument(help="Text to tokenize; '-' reads stdin.")],
    model: ModelOpt = None,
    special: Annotated[bool, typer.Option(help="Parse special tokens such as <|im_start|>.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print ids and token texts as JSON.")] = False,
):
    """Print the token ids of TEXT (for debugging prompts)."""
    with interrupts_held():
        from llamaterm.engine.store.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    text = read_prompt(text)
    ids = tokenizer.encode(text, add_special=False, parse_special=special)
    if as_json:
        typer.echo(json.dumps({"ids": ids, "tokens": [tokenizer.token_text(i) for i in ids]}))
    else:
        typer.echo(" ".join(map(str, ids)))


models_cli.register(app)  # pull, ls, rm, info


@app.command()
def presets(as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object, by name.")] = False):
    """List the presets: named system prompts and sampling values.

    --preset NAME takes one on run, chat and serve, and a pane's settings too. They live in presets.toml in your
    config folder (shown when there are none)."""
    from llamaterm.app.presets import PresetError, load_presets, presets_file

    try:
        found = load_presets()
    except PresetError as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps({p.name: {"system": p.system, **(p.sampling or {})} for p in found.values()}, indent=2))
        return
    if not found:
        say(f"No presets yet: write them in {presets_file()}, a table each, as\n\n{PRESET_EXAMPLE}")
        return
    for p in found.values():
        values = ", ".join(f"{k} {v:g}" for k, v in (p.sampling or {}).items())
        system = f"system {json.dumps(p.system)[:60]}" if p.system else ""
        echo(f"{p.name:<12}" + "; ".join(part for part in (system, values) if part))


PRESET_EXAMPLE = """[coder]
system = "You are a careful programmer: answer with the code first."
temperature = 0.2

[creative]
temperature = 1.0
top_p = 0.95"""

bench.register(app)  # bench


def main() -> None:
    from llamaterm.engine.errors import LlamatermError

    try:
        app()
    except LlamatermError as e:
        say(f"llamaterm: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
