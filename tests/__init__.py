"""The test suite, grouped as the code is, one package per room:

    engine/       the engine: API, engine process, scheduler, block manager, sampling, CUDA graphs, model runner
    checkpoints/  model files: GGUF, safetensors, tokenizers, chat templates, families, fidelity to transformers
    store/        the model store and the Hub: pull, ls, rm, info
    kernels/      the kernels: CPU, Triton, CUDA
    app/          the command line, serve, remote, bench, history, terminal output, the wheel
    tui/          the Textual app: panes, budget, snapshots (tui/__snapshots__/)

What they share is in support/ (a test module imports from there, never from another test module). benchmarks/
holds the micro-benchmarks run by hand, typing/ the mypy check `make lint` runs, data/ the oracles' files. Each
folder with tests is a package (an __init__.py), so two rooms may hold files of the same name; tests/conftest.py
refuses a test module that is not in one."""
