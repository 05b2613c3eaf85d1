"""Serving: the engine loop, scheduler, KV block manager, model forward, CUDA graphs and sampling.
May import engine.checkpoints, engine.store (to resolve a model name) and llamaterm.kernels."""
