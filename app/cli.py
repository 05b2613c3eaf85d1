"""The `llamaterm` command line. Start-up stays instant: torch and the engine load only inside commands."""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from llamaterm.app import bench, models_cli
from llamaterm.app.console import fail, imports_frozen, interrupts_held, say, startup_split
from llamaterm.app.inputs import read_file, read_prompt, reply_grammar
from llamaterm.app.terminal import TerminalStream, shown

app = typer.Typer(
    name="llamaterm",
    help="Run local LLMs (Llama, Qwen, Phi, Gemma, Mistral) from the terminal.\n\nExamples:\n\n"
    '  llamaterm run "What is the capital of France?"\n\n'
    "  echo 'Summarise: ...' | llamaterm run -\n\n"
    "  llamaterm chat --sessions 4",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model name in the store, or a path.")]
DeviceOpt = Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")]
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
        help="Load the model here, even where a `llamaterm serve` on this machine holds it (which is used by default).",
    ),
]
KvTokensOpt = Annotated[
    int | None, typer.Option(min=16, help="KV cache pool size in tokens (default: from free memory).")
]
SpeculateOpt = Annotated[
    str | None,
    typer.Option(
        help="Speculative decoding: ngram drafts tokens from the prompt and the reply so far, draft from --draft's "
        "model, off; the model verifies the drafts, so replies are the same. Default: draft with --draft, else ngram."
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(help="A small model with the model's vocabulary that drafts tokens for it (a store name or a path)."),
]
SPECULATE_KINDS = ("off", "ngram", "draft")


def speculation(speculate: str | None, draft: str | None) -> dict | None:
    """EngineConfig's speculation fields from --speculate and --draft, checked before any model loads; None when
    neither is given (the engine's default)."""
    if speculate is None and draft is None:
        return None
    kind = speculate or "draft"
    if kind not in SPECULATE_KINDS:
        fail(f"unknown --speculate {kind!r}: one of {', '.join(SPECULATE_KINDS)}", 2)
    if kind == "draft" and not draft:
        fail("--speculate draft needs a draft model: add --draft MODEL", 2)
    if draft and kind != "draft":
        fail(f"--draft gives a draft model, which --speculate {kind} does not use: leave one out", 2)
    return {"speculate": kind, "draft": draft}


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
    kv_tokens: int | None,
    server: str | None = None,
    api_key: str | None = None,
    sessions: int = 1,
    local: bool = False,
    verbose: bool = False,
    speculate: dict | None = None,
):
    """With --server, that server's `model` (None: its first). Else a `llamaterm serve` on this machine that holds
    `model` (app/announcements.py), unless `local`, --kv-tokens or speculate (speculation()'s fields: --speculate,
    --draft), which shape a local engine, say otherwise; else the local engine on `model` for `sessions` requests at a
    time (so start-up prepares no more). verbose: say which, and where a local start-up's time went."""
    if server:
        from llamaterm.app.remote import RemoteEngine

        return RemoteEngine(server, model, api_key)
    note = (lambda message: say(f"llamaterm: {message}")) if verbose else (lambda message: None)
    if not local and kv_tokens is None and speculate is None:
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
    config = EngineConfig(
        model=model, device=device, kv_tokens=kv_tokens, max_running=min(64, sessions), **(speculate or {})
    )
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
def run(
    prompt: Annotated[str | None, typer.Argument(help="The prompt; '-' or none reads stdin.")] = None,
    model: ModelOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 512,
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
    device: DeviceOpt = None,
    kv_tokens: KvTokensOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
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
    given = checked_sampling(
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
    spec = speculation(speculate, draft)
    with load_engine(model, device, kv_tokens, server, api_key, len(prompts), local, verbose, spec) as engine:
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


@dataclass
class Reply:
    text: str  # the answer: the reply less its thinking
    token_ids: list[int]
    finish_reason: str | None
    thinking: str | None = None  # what the model wrote between <think> and </think>, if it thinks
    logprobs: list = field(default_factory=list)  # TokenLogprob of each reply token, when asked for


def collect(handle, echo: bool = False, hide_thinking: bool = False, fatal: bool = True) -> Reply:
    """Read a request's events to the end; with echo, stream the answer to stdout as it arrives, and the
    thinking (unless hidden) to stderr. A request that fails exits (fatal), or says so and ends with the
    finish reason "error" (a chat goes on: a server refuses a prompt over the context in its events)."""
    from llamaterm.engine.thinking import ThinkingSplitter

    reply, split = Reply("", [], None), ThinkingSplitter()
    out, thought = TerminalStream(sys.stdout), TerminalStream(sys.stderr)

    def take(thinking: str, answer: str) -> None:
        if thinking and not hide_thinking:
            reply.thinking = (reply.thinking or "") + thinking
            if echo:
                show_thinking(thought.push(thinking))
        if answer and echo:
            if reply.thinking and not reply.text:
                show_thinking("\n")  # the answer starts on a line of its own
            sys.stdout.write(out.push(answer))
            sys.stdout.flush()
        reply.text += answer

    for event in handle.events():
        if event.error:
            if fatal:
                fail(f"generation failed: {event.error}")
            say(f"llamaterm: generation failed: {event.error}")
            reply.finish_reason = "error"
            return reply
        take(*split.push(event.text))
        reply.token_ids += event.token_ids
        reply.logprobs += event.logprobs
        reply.finish_reason = event.finish_reason
    take(*split.finish())
    if echo:
        show_thinking(thought.flush())
        sys.stdout.write(out.flush() + "\n")
    return reply


def show_thinking(text: str) -> None:
    """Thinking goes to stderr, dimmed on a terminal."""
    if text:
        sys.stderr.write(f"\x1b[2m{text}\x1b[0m" if sys.stderr.isatty() else text)
        sys.stderr.flush()


def report(handle) -> None:
    st = handle.stats()
    ttft = f"{st.ttft_s:.2f}" if st.ttft_s is not None else "-"
    typer.echo(f"[{st.generated_tokens} tokens, {st.tokens_per_s:.1f} tok/s, TTFT {ttft} s]", err=True)


@app.command()
def chat(
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="Model name in the store, or a path; on a --server, one of its models. Repeat it to "
            "put the panes on several models in turn (the TUI).",
        ),
    ] = None,
    sessions: Annotated[int, typer.Option(min=1, max=8, help="Conversation panes side by side.")] = 1,
    system: Annotated[str | None, typer.Option(help="System prompt for every session.")] = None,
    plain: Annotated[bool, typer.Option(help="A line-based chat for pipes and dumb terminals.")] = False,
    temperature: Annotated[
        float | None, typer.Option(help="With --plain: 0 is greedy. Default: the model's (the TUI: a pane's settings).")
    ] = None,
    max_tokens: int = 1024,
    device: DeviceOpt = None,
    kv_tokens: KvTokensOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    local: LocalOpt = False,
):
    """Chat with a model: the TUI, or a line REPL with --plain (/reset starts over, /exit or Ctrl-D quits). --plain
    uses a `llamaterm serve` on this machine that holds the model, unless --local."""
    spec = speculation(speculate, draft)
    if not plain:
        from llamaterm.app.tui.app import run_tui
        from llamaterm.app.tui.backends import Backend

        return run_tui([Backend(m, server or "") for m in models or [""]], sessions, system, api_key, spec)
    given = checked_sampling(temperature=temperature, max_tokens=max_tokens)
    from llamaterm.engine.errors import RequestError

    messages = [{"role": "system", "content": system}] if system else []
    if models and len(models) > 1:
        fail("--plain chats with one model: give one --model", 2)
    with load_engine(
        models[0] if models else None, device, kv_tokens, server, api_key, local=local, speculate=spec
    ) as engine:
        params = model_sampling(engine, given)
        say(f"llamaterm chat: {engine.model_name} on {engine.device}. /reset starts over, /exit quits.")
        if isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8 is refused, as in a C.UTF-8 locale,
            sys.stdin.reconfigure(errors="surrogateescape")  # not a traceback where the locale decodes strictly
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                messages = messages[:1] if system else []
                continue
            if not line.strip():
                continue
            try:
                handle = engine.submit(messages + [{"role": "user", "content": line}], params)
            except RequestError as e:
                say(f"llamaterm: {e}")
                continue
            reply = collect(handle, echo=True, fatal=False)
            if reply.finish_reason == "error":
                continue
            messages += [{"role": "user", "content": line}, {"role": "assistant", "content": reply.text}]
            report(handle)


@app.command()
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
    device: DeviceOpt = None,
    kv_tokens: KvTokensOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM or Ctrl-C, how long the requests in flight may finish (new ones get 503) before they "
            "end with an error.",
        ),
    ] = 10,
):
    """Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models,
    /health and /metrics. Requests from every client are batched by the one engine.

    Example: llamaterm serve --port 8000, then point any OpenAI client at http://127.0.0.1:8000/v1
    """
    if api_key == "":  # not a key at all: serving without one must be asked for by leaving the option out
        fail("--api-key is empty: give a key, or leave the option out to serve without one", 2)
    with interrupts_held():
        from llamaterm.app.announcements import Announcer, served_model
        from llamaterm.app.server.handlers import LOOPBACK
        from llamaterm.app.server.http_server import check_port
        from llamaterm.app.server.http_server import serve as serve_http
        from llamaterm.app.server.supervisor import EngineSupervisor
        from llamaterm.engine.api import EngineConfig
        from llamaterm.engine.serving.process import EngineProcess

    problem = check_port(host, port)
    if problem:
        fail(f"cannot listen on {host}:{port}: {problem}: choose another --port or --host", 2)
    if api_key is None and host not in LOOPBACK:
        typer.echo(
            f"llamaterm: warning: anyone who reaches {host}:{port} can use the model: consider --api-key", err=True
        )
    config = EngineConfig(model=model, device=device, kv_tokens=kv_tokens, **(speculation(speculate, draft) or {}))
    with EngineSupervisor(lambda: EngineProcess(config)) as supervisor:
        engine = supervisor.engine
        for warning in engine.sampling_defaults.warnings:
            typer.echo(f"llamaterm: warning: {warning}", err=True)
        typer.echo(
            f"llamaterm serve: {engine.model_name} on {engine.device} at http://{host}:{port}/v1 (Ctrl-C stops)",
            err=True,
        )
        # run and chat --plain on this machine find the server by its announcement, once it answers
        held = served_model(model, engine.model_name)
        serve_http(supervisor, host, port, api_key, shutdown_timeout, Announcer(host, port, engine.device, [held]))


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
