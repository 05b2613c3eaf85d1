"""What the tests share; test modules import from here, never from each other. By module:

    cli              the `llamaterm` command in a subprocess, as a user runs it
    capped           untrusted input in a child process under a memory cap; the CLI under it
    fake_engine      a stand-in engine that streams canned text (deterministic screens and servers)
    serve_support    `llamaterm serve` as a subprocess, the server on a test's engine in a thread, /metrics
    tui_support      running a Pilot scenario, waiting for a condition, for the engine, for idle panes
    locked_files     files this process may not write: read-only ones, SQLite files another process holds
    tiny_models      small random Llama models as real GGUF files
    safetensors_files  a small dense Llama in the Hugging Face layout; HF -> GGUF tensor names
    tokenizer_files  small SentencePiece and byte-level vocabularies, GGUF metadata, Qwen3's real files
    family_oracle    tiny transformers models per family, their logits and greedy tokens, llama.cpp's converter
    engine_checks    our engine's logits and greedy tokens; the GPU's greedy choices against the fp32 CPU path;
                     every KV block back
    kernel_cases     random quantized weights and paged KV caches for the kernel tests
    sampling_cases   sampler rows in the engine's tables, and logits shaped like a model's
    sampling_oracle  the row-by-row sampler, the batched one's oracle
    hub_server       a Hugging Face Hub look-alike on 127.0.0.1, with faults to inject
    hub_store        the store as the Hub tests see it: the CLI against it, its folders, a failed pull's checks
    fuzz             the model-file mutator and its harness (fuzz_worker: the capped loader process)

ROOT is the repository, DATA the tests' oracle files (tests/data)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
