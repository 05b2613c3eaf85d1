"""The flags that shape a local engine (--device, --ctx, --kv-tokens, --gpu-memory, --threads, --speculate, --draft),
defined once for every command that loads one: `@engine_flags` puts them into a command's options where its
`flags: EngineFlags` parameter stands, and hands the command them as one EngineFlags."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Annotated, get_type_hints

import typer

from llamaterm.app import models_cli
from llamaterm.app.console import fail

SPECULATE_KINDS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class EngineFlags:
    """The flags as given (None: not given). Each field's annotation is its option, as Typer reads it."""

    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None
    ctx: Annotated[
        int | None,
        typer.Option(
            "--ctx",
            min=16,
            help="Context length: the most tokens a conversation holds, prompt and reply (ollama's num_ctx, "
            "llama.cpp's -c). Default and most: the model's own.",
            show_default=False,
        ),
    ] = None
    kv_tokens: Annotated[
        int | None, typer.Option(min=16, help="KV cache pool size in tokens (default: from free memory).")
    ] = None
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            help="The share of the GPU's memory (0-1] the engine may hold, as vLLM's --gpu-memory-utilization; the "
            "KV cache takes what the weights leave of it. Default: most of what is free.",
            show_default=False,
        ),
    ] = None
    threads: Annotated[
        int | None, typer.Option(min=1, help="Threads for the CPU path (default: one per core).", show_default=False)
    ] = None
    speculate: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding: ngram drafts tokens from the prompt and the reply so far, draft from "
            "--draft's model, off; the model verifies the drafts, so replies are the same. Default: draft with "
            "--draft, else ngram."
        ),
    ] = None
    draft: Annotated[
        str | None,
        typer.Option(
            help="A small model with the model's vocabulary that drafts tokens for it (a store name or a path).",
            autocompletion=models_cli.complete_model,
        ),
    ] = None

    def shape(self) -> dict:
        """The EngineConfig fields of the flags given, checked before any model loads (--device aside): any of them
        loads the model in the command's own process rather than use a server that holds it."""
        if self.gpu_memory is not None and not 0 < self.gpu_memory <= 1:
            fail(
                f"--gpu-memory {self.gpu_memory:g} is not a share of the GPU's memory: give a number in (0, 1], as 0.9",
                2,
            )
        given = {
            "kv_tokens": self.kv_tokens,
            "context_length": self.ctx,
            "gpu_memory": self.gpu_memory,
            "threads": self.threads,
        }
        return {k: v for k, v in given.items() if v is not None} | self.speculation()

    def speculation(self) -> dict:
        """EngineConfig's speculation fields from --speculate and --draft, checked; none when neither is given (the
        engine's default)."""
        if self.speculate is None and self.draft is None:
            return {}
        kind = self.speculate or "draft"
        if kind not in SPECULATE_KINDS:
            fail(f"unknown --speculate {kind!r}: one of {', '.join(SPECULATE_KINDS)}", 2)
        if kind == "draft" and not self.draft:
            fail("--speculate draft needs a draft model: add --draft MODEL", 2)
        if self.draft and kind != "draft":
            fail(f"--draft gives a draft model, which --speculate {kind} does not use: leave one out", 2)
        return {"speculate": kind, "draft": self.draft}


def engine_flags(command):
    """`command` with EngineFlags' options in place of its `flags` parameter (Typer reads a command's options from
    its signature), called with them gathered into `flags`."""
    options = get_type_hints(EngineFlags, include_extras=True)
    signature = inspect.signature(command, eval_str=True)  # Typer takes a __signature__ as it stands
    params = []
    for param in signature.parameters.values():
        if param.name == "flags":
            params += [
                inspect.Parameter(f.name, param.kind, default=f.default, annotation=options[f.name])
                for f in fields(EngineFlags)
            ]
        else:
            params.append(param)

    @functools.wraps(command)
    def with_flags(**given):
        flags = EngineFlags(**{f.name: given.pop(f.name) for f in fields(EngineFlags)})
        return command(**given, flags=flags)

    with_flags.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return with_flags
