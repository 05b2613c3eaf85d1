"""Model name -> checkpoint + tokenizer, whatever the format on disk."""

from pathlib import Path

from llamaterm.engine.checkpoints.tokenizer import Tokenizer
from llamaterm.engine.errors import ModelFormatError, reading_model
from llamaterm.engine.store.model_store import resolve_model


def load_checkpoint(name: str | None):
    """Returns (Checkpoint, Tokenizer, path). A .gguf file loads as GGUF; a folder as a safetensors repo."""
    path = resolve_model(name)
    if path.is_dir():
        from llamaterm.engine.checkpoints.safetensors_loader import load_safetensors

        with reading_model(path):
            ckpt = load_safetensors(path)
            return ckpt, Tokenizer.from_hf_dir(path, ckpt.config.vocab_size), path
    if path.suffix != ".gguf":
        raise ModelFormatError(f"{path}: not a .gguf file or a model folder; llamaterm loads GGUF and safetensors")
    from llamaterm.engine.checkpoints.gguf import load_gguf

    with reading_model(path):
        ckpt = load_gguf(path)
        return ckpt, Tokenizer.from_gguf_metadata(ckpt.metadata), Path(path)


def load_tokenizer(name: str | None) -> Tokenizer:
    """Just the tokenizer, without converting any weights."""
    path = resolve_model(name)
    with reading_model(path):
        if path.is_dir():
            return Tokenizer.from_hf_dir(path)
        from llamaterm.engine.checkpoints.gguf import read_gguf_info

        return Tokenizer.from_gguf_metadata(read_gguf_info(path)["metadata"])
