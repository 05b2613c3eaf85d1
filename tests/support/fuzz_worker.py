"""The fuzz test's loader process (tests/support/fuzz.py starts it; it caps its own memory,
tests/support/capped.py): for each checkpoint path on stdin, load it as `llamaterm run` would, render a chat prompt,
generate two tokens, read it as `llamaterm info` would, and print one JSON line: ok, a LlamatermError's message, or
any other exception's traceback."""

import json
import sys
import traceback
from pathlib import Path

import torch

from llamaterm.engine.api import EngineConfig
from llamaterm.engine.checkpoints.checkpoint_info import read_checkpoint
from llamaterm.engine.errors import LlamatermError
from llamaterm.engine.sampling_params import SamplingParams
from llamaterm.engine.serving.engine import Engine
from llamaterm.engine.serving.engine_core import EngineCore
from llamaterm.engine.serving.model import Model
from llamaterm.engine.store.loader import load_checkpoint
from tests.support.capped import cap_memory


def try_case(path: str) -> dict:
    try:
        read_checkpoint(Path(path))
        ckpt, tokenizer, _ = load_checkpoint(path)
        model = Model(ckpt.config, ckpt.tensors, torch.device("cpu"), torch.float32)
        with Engine(EngineCore(model, tokenizer, EngineConfig(kv_tokens=256, cuda_graphs=False))) as engine:
            engine.generate([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=2))
        return {"outcome": "ok"}
    except LlamatermError as e:
        return {"outcome": "error", "message": str(e)}
    except Exception:  # what the test is looking for: anything but a clean error
        return {"outcome": "exception", "message": traceback.format_exc()}


def main() -> None:
    cap_memory()
    torch.set_num_threads(1)
    print(json.dumps({"outcome": "ready"}), flush=True)
    for line in sys.stdin:
        print(json.dumps(try_case(line.strip())), flush=True)


if __name__ == "__main__":
    main()
