"""CUDA graphs on the CPU, for the engine's tests: the capture alone stubbed (the work is recorded as a callable
that each replay runs again over the live buffers); the padded buffers and the eager steps over them are real."""

import torch

from llamaterm.engine.serving.cuda_graph import StepGraphs
from llamaterm.engine.serving.model import run_through


class Recorded:
    """A CUDA graph's stand-in: each replay runs the recorded work again and writes its output in place."""

    def __init__(self, work, out: torch.Tensor):
        self.work, self.out, self.replays = work, out, 0

    @torch.inference_mode()  # (the output is made in inference mode, as the work runs)
    def replay(self) -> None:
        self.out.copy_(self.work())
        self.replays += 1


def record_without_running(self: StepGraphs, work):
    """As a capture, nothing takes effect: the work runs once, a piece at a time as a capture records it, over
    padding alone (no KV written, nothing sampled), for its output's shape; between pieces, where live steps run,
    the live buffers are back."""
    pieces = work()
    while True:
        live = self.flat.clone(), self.tables.clone()
        self.flat.copy_(self._padding[0])
        self.tables.copy_(self._padding[1])
        try:
            next(pieces)
        except StopIteration as done:
            out = done.value
            break
        finally:
            self.flat.copy_(live[0])
            self.tables.copy_(live[1])
        yield
    return Recorded(lambda: run_through(work()), out), out
