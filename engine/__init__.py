"""The inference engine, in three rooms. checkpoints/ reads model files (GGUF, safetensors, tokenizers, chat
templates) and imports no other room; store/ keeps models on disk and fetches them from the Hub, over
checkpoints/; serving/ runs them (engine loop, scheduler, KV blocks, model, sampling) over both.
api.py (the contract callers see), sampling_params.py and errors.py belong to every room and import none of them;
bench.py (the workloads `llamaterm bench` runs) sits above the rooms and may import them all."""
